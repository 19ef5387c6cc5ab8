"""Which of a worker's streams reach the agent's console, and how: torchrun's rules.

Owns one pure decision per local rank, from the run's configuration: a stream that is
neither redirected nor tee'd is the agent's own in torchrun (shown unmodified, and a
terminal stays a terminal); a tee'd one is shown line by line after torchrun's prefix
``[<role><local_rank>]:`` (or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` /
``--log-line-prefix-template``); a redirected one, or any stream of a rank that
``--local-ranks-filter`` leaves out, only goes to its log file.
"""

from __future__ import annotations

import socket
from string import Template

from flexrun.config import RunConfig
from flexrun.proc.drain import Console


def console_plan(config: RunConfig, local_rank: int, rank: int) -> Console:
    """How local rank ``local_rank`` (global ``rank``) is shown on the console."""
    shown = config.console_for(local_rank)
    teed = config.tee.of(local_rank) & shown
    if config.log_line_prefix_template is not None:
        prefix = Template(config.log_line_prefix_template).safe_substitute(
            role_name=config.role,
            rank=rank,
            local_rank=local_rank,
            hostname=socket.getfqdn(),
        )
    else:
        prefix = f"[{config.role}{local_rank}]:"
    return Console(shown, {stream: prefix for stream in teed})
