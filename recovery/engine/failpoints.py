"""Named fault points at every step boundary, inert unless ``RECOVERY_FAILPOINTS`` arms them.

``RECOVERY_FAILPOINTS="STEP:POINT=ACTION[,…]"`` with POINT one of before_intent, before_call,
after_call, after_outcome and ACTION one of crash (hard exit, like SIGKILL), raise, sleep(MS).
``*`` as STEP arms the point for every step. An agent's journal rows are steps too: STEP may be
``agent:turn`` (a model turn) or ``agent:turn:index:tool`` (a tool call).
"""

from __future__ import annotations

import os
import re
import signal
import time
from functools import lru_cache

POINTS = ("before_intent", "before_call", "after_call", "after_outcome")
_ENTRY = re.compile(r"^(?P<step>[\w*.:-]+):(?P<point>\w+)=(?P<action>crash|raise|sleep\((?P<ms>\d+)\))$")


class FailpointRaised(Exception):
    """Raised by a failpoint armed with ``raise``. The executor never catches it: it
    leaves the run exactly as a crash at that point would."""


@lru_cache(maxsize=8)
def parse(spec: str) -> dict[tuple[str, str], str]:
    armed: dict[tuple[str, str], str] = {}
    for raw in filter(None, (part.strip() for part in spec.split(","))):
        match = _ENTRY.match(raw)
        if not match or match["point"] not in POINTS:
            raise ValueError(
                f"bad RECOVERY_FAILPOINTS entry {raw!r}: expected STEP:POINT=ACTION with POINT in "
                f"{', '.join(POINTS)} and ACTION crash, raise or sleep(MS)"
            )
        armed[(match["step"], match["point"])] = match["action"]
    return armed


def hit(step: str, point: str) -> None:
    spec = os.environ.get("RECOVERY_FAILPOINTS", "")
    if not spec:
        return
    armed = parse(spec)
    action = armed.get((step, point)) or armed.get(("*", point))
    if action is None:
        return
    if action == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise FailpointRaised(f"failpoint {step}:{point}")
    time.sleep(int(action[len("sleep(") : -1]) / 1000)
