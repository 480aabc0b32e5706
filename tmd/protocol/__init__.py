"""The protocol package: everything every party (tmd, worker agents, tmctl, the SLURM hooks) agrees on.

- :mod:`tmd.protocol.messages`: the wire messages (re-exported here: ``from tmd import protocol as p; p.Assign``);
- :mod:`tmd.protocol.vocab`: roles, states, phases, health, exit codes and journal event names, as enums;
- :mod:`tmd.protocol.layout`: store-key prefixes, run-directory files and the per-user state directory.
"""
from tmd.protocol.messages import *  # noqa: F401,F403
from tmd.protocol.messages import Message, ProtocolError, PROTOCOL_VERSION, decode, encode  # noqa: F401
from tmd.protocol.vocab import *  # noqa: F401,F403
from tmd.protocol import layout, vocab  # noqa: F401
