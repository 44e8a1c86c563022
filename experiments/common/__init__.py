"""What the experiments share: their flags' checks and resume checks (:mod:`.flags`), one
checkpointed training phase of a run folder (:mod:`.phase`), the language-model measurements
(:mod:`.measure`), timing and markdown tables for benchmarks (:mod:`.timing`) and the statistics
of a comparison (:mod:`.stats`), and the bundled teacher's files (:mod:`.teachers`). A run's
files are written whole by :mod:`sparse_jax.files`."""
