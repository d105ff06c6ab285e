"""The SGLang system of ``miles bench engine``: job in, timings out, in SGLang's own environment.

SGLang needs CUDA, so ``sglang`` here is a stand-in module (its ``Engine`` echoes ``max_new_tokens``
tokens per prompt) on the PYTHONPATH the system is given; the H200 script runs the real one
(``scripts/h200/sglang_bench.sh``). What this checks is the runner and the plumbing: the
environment (Miles' PYTHONPATH never reaches SGLang), the job, and the result.
"""

from __future__ import annotations

import sys
import textwrap

from miles_engine.bench.systems import SGLangSystem
from miles_engine.bench.workload import Workload

STAND_IN = textwrap.dedent('''
    import os
    __version__ = "stand-in"
    class Engine:
        def __init__(self, **settings):
            assert "miles" not in os.environ.get("PYTHONPATH", ""), os.environ.get("PYTHONPATH")
            self.settings = settings
        def generate(self, input_ids, sampling_params):
            n = sampling_params["max_new_tokens"]
            return [{"output_ids": [1] * n, "meta_info": {"completion_tokens": n}} for _ in input_ids]
        def get_server_info(self):
            return {"attention_backend": self.settings["attention_backend"], "disable_radix_cache": True}
        def shutdown(self):
            pass
''')


def test_the_sglang_system_runs_every_concurrency_in_sglangs_environment(tmp_path, monkeypatch):
    (tmp_path / "sglang.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/miles-site")
    system = SGLangSystem(sys.executable, "/models/m", dtype="bfloat16", env={"PYTHONPATH": str(tmp_path)},
                          attention_backend="triton", timeout=120)
    runs = system.run_all(Workload(prompts=[[1, 2], [3]], max_new_tokens=5), [1, 4], repeats=2)
    assert sorted(runs) == [1, 4]
    assert [r.tokens for r in runs[4].runs] == [20, 20] and runs[4].warmup.tokens == 20
    assert all(r.seconds > 0 for r in runs[1].runs)
    assert system.info["version"] == "stand-in" and system.info["server"]["attention_backend"] == "triton"
