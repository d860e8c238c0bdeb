"""Flax NNX modules built from sluice's ops: the MoE layer (moe) and the decoder LM (model)."""
