"""File data sources on real files: JSONL, parquet, Hugging Face datasets folders."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from miles.context import context_for
from miles.data import DataError, eval_prompts, open_data_source, source_metrics
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.sections import DataSection

LINES = [
    '{"question": "1+1?", "answer": 2}',
    "",
    '{"question": "2+2?", "answer": "4", "metadata": {"reward": "f1"}}',
    "not json at all",
    "[1, 2]",
    '{"answer": "no prompt"}',
    '{"question": "3+3?", "answer": 6}',
]


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    selection = PluginSelection(enable=("data",))
    return Kernel(load_plugins(selection), selection)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def numbered(path: Path, n: int) -> Path:
    return write_jsonl(path, [{"prompt": f"p{i}", "label": str(i)} for i in range(n)])


def config(path: Path | str, **kw) -> DataSection:
    return DataSection(source=kw.pop("source", "jsonl"), path=str(path), prompt_key=kw.pop("prompt_key", "prompt"), **kw)


def test_malformed_lines_are_skipped_counted_and_reported_with_file_and_line(kernel: Kernel, tmp_path: Path, caplog) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    with caplog.at_level(logging.WARNING):
        source = open_data_source(context_for(kernel=kernel), config(path, prompt_key="question", label_key="answer", shuffle=False))
    assert len(source) == 3
    assert source_metrics(source)["data/skipped_records"] == 3.0
    assert "skipped 3 malformed record(s)" in caplog.text
    assert f"{path}:4: not valid JSON" in caplog.text
    assert f"{path}:5: expected a JSON object, got list" in caplog.text
    assert f"{path}:6: no prompt field 'question' (data.prompt_key); the record has: answer" in caplog.text
    samples = source.next_prompts(3)
    assert [s.label for s in samples] == ["2", "4", "6"]  # numbers become text labels
    assert samples[1].metadata["reward"] == "f1"  # per-sample reward choice survives
    assert samples[2].metadata["data_location"] == f"{path}:7"


def test_a_deeply_nested_line_is_a_skipped_counted_record_not_a_recursion_error(kernel: Kernel, tmp_path: Path,
                                                                                 caplog) -> None:
    """Ten thousand levels overflow json.loads' recursion; five hundred parse, and then broke what
    walks a sample later (the loop's group buffer deep-copies samples; copy.deepcopy and pickle
    overflow at that depth). Both are records with a reason, as any other malformed line."""
    path = tmp_path / "train.jsonl"
    beyond_the_parser = '{"prompt": "a", "metadata": ' + '{"x": ' * 10_000 + "1" + "}" * 10_001
    parsed_but_too_deep = '{"prompt": "b", "metadata": {"x": ' + "[" * 500 + "]" * 500 + "}}"
    deep_but_ordinary = '{"prompt": "c", "metadata": ' + '{"x": ' * 20 + "1" + "}" * 21  # tool schemas nest this far
    path.write_text("\n".join([beyond_the_parser, parsed_but_too_deep, deep_but_ordinary, '{"prompt": "d"}']) + "\n")
    with caplog.at_level(logging.WARNING):
        source = open_data_source(context_for(kernel=kernel), config(path, shuffle=False))
    assert len(source) == 2 and source_metrics(source)["data/skipped_records"] == 2.0
    for line in (1, 2):
        assert f"{path}:{line}: refused: JSON arrays and objects nest deeper than 100 levels" in caplog.text
    assert [s.prompt[0]["content"] for s in source.next_prompts(2)] == ["c", "d"]
    with pytest.raises(DataError, match=r":1: refused: JSON arrays and objects nest deeper"):
        open_data_source(context_for(kernel=kernel), config(path, on_error="fail"))


def test_on_error_fail_stops_at_the_first_malformed_line(kernel: Kernel, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    with pytest.raises(DataError) as info:
        open_data_source(context_for(kernel=kernel), config(path, prompt_key="question", on_error="fail"))
    message = str(info.value)
    assert message.startswith(f"{path}:4: not valid JSON (Expecting value at column 1)")
    assert "set data.on_error=skip" in message


def test_prompt_template_system_prompt_and_chat_format(kernel: Kernel, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"q": "2+2", "unit": "apples", "a": 4}])
    chat = open_data_source(context_for(kernel=kernel), config(path, prompt_key="q", label_key="a", template="How many {unit} is {prompt}?",
                                   system_prompt="Be brief.")).next_prompts(1)[0]
    assert chat.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many apples is 2+2?"}]
    plain = open_data_source(context_for(kernel=kernel), config(path, prompt_key="q", label_key="a", template="Q: {prompt}\nA:",
                                    system_prompt="Be brief.", apply_chat_template=False)).next_prompts(1)[0]
    assert plain.prompt == "Be brief.\n\nQ: 2+2\nA:"
    assert plain.label == "4"


def test_message_list_prompts_are_used_as_given(kernel: Kernel, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": messages, "label": None}])
    sample = open_data_source(context_for(kernel=kernel), config(path, system_prompt="S")).next_prompts(1)[0]
    assert sample.prompt == [{"role": "system", "content": "S"}, *messages] and sample.label is None
    with pytest.raises(DataError, match="m.jsonl:1: the prompt is a message list but data.apply_chat_template is false"):
        open_data_source(context_for(kernel=kernel), config(path, apply_chat_template=False, on_error="fail"))


def test_template_problems_are_reported(kernel: Kernel, tmp_path: Path) -> None:
    path = numbered(tmp_path / "n.jsonl", 2)
    with pytest.raises(DataError, match=r"n.jsonl:1: data.template uses \{missing\} but the record has no such field"):
        open_data_source(context_for(kernel=kernel), config(path, template="{missing}: {prompt}", on_error="fail"))
    with pytest.raises(DataError, match="data.template is not a valid format string"):
        open_data_source(context_for(kernel=kernel), config(path, template="{prompt"))


def test_shuffle_is_deterministic_per_seed_and_reshuffled_every_epoch(kernel: Kernel, tmp_path: Path) -> None:
    path = numbered(tmp_path / "n.jsonl", 20)
    first = [s.label for s in open_data_source(context_for(kernel=kernel), config(path, seed=1)).next_prompts(40)]
    again = [s.label for s in open_data_source(context_for(kernel=kernel), config(path, seed=1)).next_prompts(40)]
    other = [s.label for s in open_data_source(context_for(kernel=kernel), config(path, seed=2)).next_prompts(40)]
    assert first == again
    assert first != other
    epoch0, epoch1 = first[:20], first[20:]
    assert sorted(epoch0, key=int) == sorted(epoch1, key=int) == [str(i) for i in range(20)]  # each epoch: every record once
    assert epoch0 != epoch1
    in_order = [s.label for s in open_data_source(context_for(kernel=kernel), config(path, shuffle=False)).next_prompts(25)]
    assert in_order == [str(i) for i in range(20)] + [str(i) for i in range(5)]


def test_resuming_from_the_saved_position_gives_the_same_order(kernel: Kernel, tmp_path: Path) -> None:
    path = numbered(tmp_path / "n.jsonl", 10)
    running = open_data_source(context_for(kernel=kernel), config(path, seed=3))
    running.next_prompts(7)
    state = json.loads(json.dumps(running.state_dict()))  # what a checkpoint stores
    expected = [(s.label, s.metadata["data_epoch"]) for s in running.next_prompts(15)]
    resumed = open_data_source(context_for(kernel=kernel), config(path, seed=3))
    resumed.load_state_dict(state)
    assert [(s.label, s.metadata["data_epoch"]) for s in resumed.next_prompts(15)] == expected
    assert source_metrics(resumed)["data/epoch"] == 2.0

    changed = open_data_source(context_for(kernel=kernel), config(numbered(tmp_path / "more.jsonl", 11), seed=3))
    with pytest.raises(DataError, match="saved data position is for 10 records with seed 3.*now has 11 records"):
        changed.load_state_dict(state)


def test_a_folder_of_jsonl_files_is_read_in_name_order(kernel: Kernel, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", [{"prompt": "b0"}])
    write_jsonl(folder / "a.jsonl", [{"prompt": "a0"}, {"prompt": "a1"}])
    (folder / "notes.txt").write_text("ignored")
    source = open_data_source(context_for(kernel=kernel), config(folder, shuffle=False))
    assert [s.prompt[0]["content"] for s in source.next_prompts(3)] == ["a0", "a1", "b0"]


def test_parquet_files(kernel: Kernel, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"problem": ["1+2", None, "5*5"], "solution": ["3", "x", "25"]}), path)
    source = open_data_source(context_for(kernel=kernel), config(path, source="parquet", prompt_key="problem", label_key="solution", shuffle=False))
    assert [(s.prompt[0]["content"], s.label) for s in source.next_prompts(2)] == [("1+2", "3"), ("5*5", "25")]
    with pytest.raises(DataError, match=r"train.parquet row 1: prompt field 'problem' is a NoneType"):
        open_data_source(context_for(kernel=kernel), config(path, source="parquet", prompt_key="problem", on_error="fail"))


def test_datasets_folders_saved_to_disk_and_plain_file_folders(kernel: Kernel, tmp_path: Path) -> None:
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt": ["t0", "t1"], "label": ["0", "1"]}),
        "test": datasets.Dataset.from_dict({"prompt": ["e0"], "label": ["9"]}),
    }).save_to_disk(str(saved))
    train = open_data_source(context_for(kernel=kernel), config(saved, source="hf_dataset", shuffle=False))
    assert [s.label for s in train.next_prompts(2)] == ["0", "1"]
    test = open_data_source(context_for(kernel=kernel), config(saved, source="hf_dataset", options={"split": "test"}))
    assert test.next_prompts(1)[0].metadata["data_location"] == f"{saved} [test] row 0"
    with pytest.raises(DataError, match="has no split 'validation'; it has train, test"):
        open_data_source(context_for(kernel=kernel), config(saved, source="hf_dataset", options={"split": "validation"}))

    files = tmp_path / "hub_download" / "data"
    files.mkdir(parents=True)
    write_jsonl(files / "train.jsonl", [{"prompt": "f0", "label": "a"}, {"prompt": "f1", "label": "b"}])
    downloaded = open_data_source(context_for(kernel=kernel), config(files.parent, source="hf_dataset", shuffle=False))
    assert [s.label for s in downloaded.next_prompts(2)] == ["a", "b"]


def test_eval_prompts_come_from_eval_path_in_file_order(kernel: Kernel, tmp_path: Path) -> None:
    train = numbered(tmp_path / "train.jsonl", 5)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"e{i}", "label": str(i)} for i in range(3)])
    cfg = config(train, eval_path=str(held_out))
    samples = eval_prompts(context_for(kernel=kernel), 10, config=cfg)
    assert [s.label for s in samples] == ["0", "1", "2"]  # at most what the file holds, in file order
    assert all(s.metadata["split"] == "eval" for s in samples)
    assert [s.label for s in eval_prompts(context_for(kernel=kernel), 2, config=cfg)] == ["0", "1"]
    with pytest.raises(DataError, match="has no held-out split of its own: set data.eval_path"):
        eval_prompts(context_for(kernel=kernel), 2, config=config(train))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"path": None}, "data source 'jsonl' reads files: set data.path"),
        ({"path": "/nonexistent/x.jsonl"}, "'/nonexistent/x.jsonl' does not exist"),
        ({"options": {"split": "train"}}, "data.options.split: not an option of this data source"),
    ],
)
def test_setup_errors_say_what_to_fix(kernel: Kernel, tmp_path: Path, kw: dict, message: str) -> None:
    base = {"source": "jsonl", "path": str(numbered(tmp_path / "n.jsonl", 1))}
    with pytest.raises(DataError) as info:
        open_data_source(context_for(kernel=kernel), DataSection(**{**base, **kw}))
    assert message in str(info.value)


def test_a_file_with_no_usable_records_is_an_error(kernel: Kernel, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("oops\n{}\n")
    with pytest.raises(DataError, match=r"found no prompts .*all 2 records were malformed"):
        open_data_source(context_for(kernel=kernel), config(path))


@pytest.mark.parametrize(("source", "module"), [("parquet", "pyarrow.parquet"), ("hf_dataset", "datasets")])
def test_a_missing_data_extra_names_the_install_command(kernel: Kernel, tmp_path: Path, monkeypatch, source: str, module: str) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when the package is not installed
    with pytest.raises(DataError, match=r"pip install 'miles-kernel\[data\]'"):
        open_data_source(context_for(kernel=kernel), config(tmp_path / "data", source=source))
