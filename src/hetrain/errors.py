"""The two error bases: bad input, and a failure while running.

Every error hetrain raises on purpose derives from one of them, so a command
line catches one type and prints one line::

    HetrainError
    ├── InputError (ValueError)   a file, a field or an argument that is wrong:
    │                             ClusterError, ProfileError, PlanError, PlannerError,
    │                             ScheduleError, TimelineError, UnitError, ...
    └── RunError (RuntimeError)   a job that cannot go on: a peer gone silent, a
                                  device missing, a checkpoint that cannot be read, ...

An ``InputError`` message names the file (where there is one), the field and
the value; a ``RunError`` message names the peer or the resource.
"""

from __future__ import annotations


class HetrainError(Exception):
    """Any error hetrain raises on purpose: its message is meant for the user as it is."""


class InputError(HetrainError, ValueError):
    """Bad input: a cluster, profile or plan file, a field of one, or a command-line argument."""


class RunError(HetrainError, RuntimeError):
    """A failure while running a job: a peer, a device, a checkpoint, the emulator."""
