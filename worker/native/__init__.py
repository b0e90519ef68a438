"""Native CPU kernels (the C sources here), compiled on this machine at first use by ``build.py``."""
