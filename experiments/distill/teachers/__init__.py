"""The bundled teacher's files (``default/``: a Hugging Face GPT-2 folder and its
``teacher.json``), shipped as package data; :mod:`experiments.common.teachers` reads them."""
