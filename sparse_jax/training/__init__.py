"""Training: losses, device-mesh sharding, checkpoints, the loop and when to stop it early
(import the submodules, e.g. ``from sparse_jax.training import losses, sharding``)."""
