"""A wheel's file name, as PEP 427 spells it: NAME-VERSION(-BUILD)?-PYTHON-ABI-PLATFORM.whl,
each tag part possibly several, dotted (``manylinux_2_17_x86_64.manylinux2014_x86_64``).
Read by the bundle (which wheel suits a target) and the agent (which it can install)."""

from __future__ import annotations

import re

WHEEL = re.compile(r"(?P<name>[^-/]+)-(?P<version>[^-/]+)(?:-[0-9][^-/]*)?"
                   r"-(?P<python>[^-/]+)-(?P<abi>[^-/]+)-(?P<platform>[^-/]+)\.whl")
# The most a wheel may be (torch's CUDA wheels are a few GB), where nobody gave its size.
MAX_WHEEL_BYTES = 16 * 2**30
