"""The command-line tools: sluice-train, sluice-prepare-data, sluice-plot, sluice-profile and
sluice-demo (each module's main)."""
