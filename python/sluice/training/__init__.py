"""What a training run is made of: the corpus and its batches (data), the optimizer (optim), and the
mesh, shardings, state and step functions (step). sluice.cli.train runs them."""
