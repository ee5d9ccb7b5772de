"""Reference models: analytic profiles (pure Python) and, in torch modules, layer lists.

This package's ``__init__`` imports no torch: ``hetrain.models.analytic`` is part
of the planning side.
"""
