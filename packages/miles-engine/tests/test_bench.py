"""``miles bench engine`` arguments. (A full run of the bench, even on the tiny model, loads two
models and takes 20-30 s on 2 shared cores; the bench is exercised by the commands in
docs/benchmarks/engine.md, never timed in tests.)"""

from __future__ import annotations

import pytest
from miles.cli.main import main


def test_fewer_than_three_repeats_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--repeats", "2"])
    assert exit_info.value.code == 2
    assert "at least 3" in capsys.readouterr().err
