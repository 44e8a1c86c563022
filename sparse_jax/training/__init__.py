"""Training: losses, device-mesh sharding, checkpoints and the loop (import the submodules, e.g.
``from sparse_jax.training import losses, sharding``)."""
