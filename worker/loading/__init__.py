"""Model loading for the worker: ``loader.py`` picks a loader by what the user named (the bundled
GGUF, a ``.gguf`` file, an mlx-lm folder, a hub id); ``errors.py`` has what it raises."""
