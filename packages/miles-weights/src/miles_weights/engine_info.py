"""What a weight sync must know about each engine, read once from its ``GET /server_info``.

Both engines speak SGLang's API, but two things differ and are asked, not assumed:

* ``tp_size``: SGLang shards a model over ``tp_size`` ranks; each takes its own entry in
  ``serialized_named_tensors`` and its own rank in a broadcast group. The embedded engine has one.
* Miles' own formats: the embedded engine (``"engine": "miles-embedded"``) takes tensors as
  ``flattened_shm`` / ``cuda_ipc`` and answers ``/weights_checksum`` with checkpoint names, so
  check mode compares every tensor with the trainer's on every sync. Any other engine (SGLang)
  takes SGLang's pickled ``flattened_bucket`` payload, and check mode goes through its
  ``/weights_checker`` (snapshot, random reset, compare) on the engine's first sync.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EMBEDDED_ENGINE = "miles-embedded"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    tp_size: int = 1
    miles_formats: bool = False
    started_at: float | None = None  # when its process started, if it says (to notice restarts)

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any]) -> EngineInfo:
        uptime = info.get("uptime_s")
        started = time.time() - float(uptime) if isinstance(uptime, int | float) else None
        return cls(tp_size=max(int(info.get("tp_size") or 1), 1), miles_formats=info.get("engine") == EMBEDDED_ENGINE,
                   started_at=started)
