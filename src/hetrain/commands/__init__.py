"""The ``hetrain`` commands, one module each: ``add_arguments(parser)`` and ``run(args) -> int``.

``hetrain.cli.COMMANDS`` lists them (with ``train``, whose module is ``hetrain.runtime.command``); the CLI
imports only the module of the command it runs. ``plan_inputs`` and ``plan_report`` are ``plan``'s parts.
"""
