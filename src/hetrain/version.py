"""hetrain's version (the package's ``__version__``), importable without the package's other modules."""

__version__ = "0.1.0"
