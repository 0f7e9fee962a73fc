"""Subcommands of the ``forwardkit`` command; each module exposes ``register(subparsers)``."""
