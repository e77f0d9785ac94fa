"""Sizes, link rates and bandwidths as users write them.

Sizes take the K/M/G suffixes (powers of 1024) of the ``FAIRRING_*`` variables, through
the same parser. Rates take ``tc``'s notation, as ``fairring-netns-cluster --rate``
does (``1gbit``, ``300mbit``; ``bps`` is *bytes* per second there), and bandwidths may
also be written ``370GB/s`` or ``25Gbit/s``. Everything is returned in bytes or bytes/s.
"""

from __future__ import annotations

import re

from fairring_pg.config import parse_byte_size

_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
# tc(8): bit/kbit/mbit/gbit/tbit are SI bits per second, kibit... IEC bits; bps/kbps/...
# are bytes per second (SI), kibps... IEC bytes; a bare number is bits per second.
_TC_UNITS = {
    "": 1 / 8,
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
    "kibit": 1024 / 8,
    "mibit": 1024**2 / 8,
    "gibit": 1024**3 / 8,
    "tibit": 1024**4 / 8,
    "bps": 1.0,
    "kbps": 1e3,
    "mbps": 1e6,
    "gbps": 1e9,
    "tbps": 1e12,
    "kibps": 1024.0,
    "mibps": 1024.0**2,
    "gibps": 1024.0**3,
    "tibps": 1024.0**4,
}
# "370GB/s", "46 GB/s", "900GiB/s" (bytes: a capital B), "25Gbit/s" (bits: "bit").
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_IEC = {"ki": 1024.0, "mi": 1024.0**2, "gi": 1024.0**3, "ti": 1024.0**4}
_RATE_HELP = (
    "expected tc's notation (1gbit, 300mbit, 400gbit; 'mbps' is megabytes per second "
    "there) or a bandwidth such as 370GB/s or 25Gbit/s"
)


def parse_size(name: str, text: str) -> int:
    """Bytes, from ``25M``, ``100MiB``, ``512K``, ``1G`` (powers of 1024) or a number."""
    return parse_byte_size(name, text)


def parse_rate(name: str, text: str) -> float:
    """Bytes per second from a link rate or bandwidth; a clear ValueError naming ``name``."""
    raw = text.strip()
    per_second = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*?)(B|bit)/s", raw)
    if per_second:
        number, prefix, unit = per_second.groups()
        scale = _PREFIX.get(prefix.lower(), _IEC.get(prefix.lower()))
        if scale is None:
            raise ValueError(f"{name}={text!r} has an unknown prefix {prefix!r}: {_RATE_HELP}")
        value = float(number) * scale * (1.0 if unit == "B" else 1 / 8)
    else:
        tc = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", raw)
        if tc is None or tc.group(2).lower() not in _TC_UNITS:
            raise ValueError(f"{name}={text!r} is not a rate: {_RATE_HELP}")
        value = float(tc.group(1)) * _TC_UNITS[tc.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be positive: {_RATE_HELP}")
    return value


def show_rate(bytes_per_s: float) -> str:
    """Bytes/s as GB/s or MB/s (powers of 1000), for tables."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.1f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def show_size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    if n >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n} B"
