"""Trajectory assembly: turn records -> one :class:`Sample` per turn -> one trajectory sample.

A turn sample is what one engine call saw and produced: ``tokens = input_ids + output_ids``,
``loss_mask = [1] * len(output_ids)``, the engine's log-probs, its weight version (per output id
when the turn spans a weight update), and a status from its finish reason. Merging folds the turns of a conversation into a single sample whose
``tokens`` are the whole conversation (the last turn's prompt plus its output); in its response:

* tokens a turn sampled have ``loss_mask`` 1, their rollout log-prob and the weight version that
  sampled them (``token_versions``);
* everything between turns (tool results, user messages, template tokens, the splice's closing
  tokens) has ``loss_mask`` 0, log-prob 0.0 and version -1;
* a turn's trailing sampled tokens that the next turn's prompt replaced (the family's
  ``trim_trailing``) are dropped, at most ``max_trim_tokens`` per turn and never on the last turn.

Every turn's prompt must be a prefix of the conversation (the token chain); otherwise the merge
fails with :class:`AssemblyError` naming the turn and token position rather than guessing.

Engine captures (per-position data such as routed experts) follow the same cut: each turn's
payload covers the positions its call reported (from the first one earlier turns had not), and
only the positions of its tokens that survive into the trajectory are kept, so the pieces tile the
trajectory's ``[0, len(tokens) - 1)`` exactly (a gap or an overlap fails the sample; see
:func:`miles.rollout.capture.store_captures`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles.rollout.capture import store_captures
from miles_contracts import Branch, CapturedPiece, EngineCapture, ExitReason, Sample, Status
from miles_contracts.wire.session import TurnRecord

_FINISH = {
    "stop": (Status.COMPLETED, ExitReason.STOP),
    "tool_calls": (Status.COMPLETED, ExitReason.TOOL_CALLS),
    "length": (Status.TRUNCATED, ExitReason.LENGTH),
}


class AssemblyError(ValueError):
    """Records that cannot form one token-exact trajectory."""


def turn_sample(record: TurnRecord) -> Sample:
    """The sample of one engine call (``tokens = input_ids + output_ids``)."""
    status, reason = _FINISH[record.finish_reason]
    versions = record.output_versions or [record.weight_version] * len(record.output_ids)
    sample = Sample(
        tokens=[*record.input_ids, *record.output_ids],
        response_length=len(record.output_ids),
        loss_mask=[1] * len(record.output_ids),
        rollout_logprobs=list(record.output_logprobs),
        weight_versions=list(dict.fromkeys(versions)) or [record.weight_version],
        token_versions=list(versions),
        metadata={"turn": record.turn, "tool_calls": len(record.message.get("tool_calls") or ()),
                  "malformed": [{"span": list(m.span), "error": m.error} for m in record.malformed_tool_calls]},
    )
    if record.format_error and status is Status.COMPLETED:
        return sample.finish(status, ExitReason.FORMAT_ERROR, f"turn {record.turn}: {record.format_error}")
    return sample.finish(status, reason)


def turn_samples(records: Sequence[TurnRecord]) -> list[Sample]:
    """One sample per turn that is part of the trajectory (rolled-back turns left out)."""
    return [turn_sample(r) for r in records if not r.rolled_back]


def merge_turns(turns: Sequence[Sample], *, max_trim_tokens: int, into: Sample | None = None) -> Sample:
    """Merge per-turn samples (in order) into one trajectory sample.

    :param turns: turn samples whose prompts chain (each a prefix of the last turn's tokens).
    :param max_trim_tokens: the chat family's limit on trailing tokens a turn may lose.
    :param into: sample to fill (prompt, label, ids and metadata are kept); a new one if None.
    :returns: ``into`` with ``tokens [P + R]``, ``loss_mask [R]``, ``rollout_logprobs [R]``,
        ``token_versions [R]`` (empty when a turn says neither per token nor by its one call which
        version sampled it), ``weight_versions`` (per engine call), status and exit reason set.
    """
    if not turns:
        raise AssemblyError("no turns to merge: the conversation has no generated turn")
    final = turns[-1].tokens
    prompt_length = turns[0].prompt_length
    loss_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] | None = []  # None once a turn cannot say which version sampled its tokens
    spans: list[list[int]] = []
    trimmed: list[int] = []
    malformed: list[dict[str, Any]] = []
    cursor = prompt_length
    for number, turn in enumerate(turns):
        start = turn.prompt_length
        if start < cursor:
            raise AssemblyError(f"turn {number}: its prompt has {start} tokens but the turns before it already cover {cursor}")
        if turn.tokens[:start] != final[:start]:
            at = _common_prefix_length(turn.tokens[:start], final)
            raise AssemblyError(
                f"turn {number}: its prompt is not a prefix of the conversation: token {at} is {turn.tokens[at]} "
                f"there but {final[at]} in the last turn"
            )
        output = turn.response_tokens
        # What survives of a turn lies inside the next turn's prompt (which holds all history), so
        # match only up to there: the next turn's own samples could repeat a trimmed token.
        end = turns[number + 1].prompt_length if number + 1 < len(turns) else len(final)
        keep = _common_prefix_length(output, final[start:end])
        lost = len(output) - keep
        if lost and (number == len(turns) - 1 or lost > max_trim_tokens):
            raise AssemblyError(
                f"turn {number}: {lost} of its sampled tokens are not in the conversation (from token {start + keep}); "
                f"the chat family allows trimming {max_trim_tokens} trailing tokens of a turn that is not the last"
            )
        loss_mask += [0] * (start - cursor) + [1] * keep
        logprobs += [0.0] * (start - cursor) + list(turn.rollout_logprobs[:keep])
        known = _sampled_versions(turn)
        versions = None if versions is None or known is None else versions + [-1] * (start - cursor) + known[:keep]
        spans.append([start - prompt_length, start - prompt_length + keep])
        # the unreadable calls, their spans in response positions (the sampled tokens stay in the loss)
        malformed += [{"turn": turn.metadata.get("turn", number), "error": m["error"],
                       "span": [start - prompt_length + m["span"][0], start - prompt_length + m["span"][1]]}
                      for m in turn.metadata.get("malformed", ())]
        trimmed.append(lost)
        cursor = start + keep

    sample = into if into is not None else Sample()
    sample.tokens = list(final)
    sample.response_length = len(final) - prompt_length
    sample.loss_mask = loss_mask
    sample.rollout_logprobs = logprobs
    sample.token_versions = versions or []
    sample.weight_versions = [v for t in turns for v in t.weight_versions]
    last = turns[-1]
    errors = [t.exit_detail for t in turns if t.exit_reason is ExitReason.FORMAT_ERROR]
    if last.status is Status.COMPLETED and errors:
        sample.finish(Status.COMPLETED, ExitReason.FORMAT_ERROR, "; ".join(e for e in errors if e))
    else:
        sample.finish(last.status, last.exit_reason, last.exit_detail)
    sample.metadata["tito"] = {"turns": len(turns), "turn_spans": spans, "trimmed": trimmed, "format_errors": len(errors)}
    sample.metadata["tool_calls"] = {"parsed": sum(int(t.metadata.get("tool_calls", 0)) for t in turns),
                                     "malformed": len(malformed), "malformed_calls": malformed}
    return sample


def assemble(records: Sequence[TurnRecord], *, max_trim_tokens: int, into: Sample | None = None) -> Sample:
    """The records of one path through a session's graph (first turn first; rolled-back records
    are skipped) -> its trajectory sample (see :func:`merge_turns`)."""
    return merge_turns(turn_samples(records), max_trim_tokens=max_trim_tokens, into=into)


def branch_sample(path: Sequence[TurnRecord], branch: Branch, *, max_trim_tokens: int, train_retried: bool = False,
                  into: Sample | None = None) -> Sample | None:
    """The sample of one episode branch: ``path`` is the branch's last turn and the turns whose ids
    its prompt extends (first turn first). All of the path is in ``tokens``; only the turns the
    branch itself generated are trained (``loss_mask`` 1): a shared prefix is context here and
    trained in the branch that generated it. A ``retried`` branch's turns are trained only with
    ``train_retried``. None when no turn of the path is trained here.

    ``weight_versions`` are the trained turns' calls (what this row's staleness is); log-probs 0.0
    and versions -1 outside them, as between turns.
    """
    trained = [r.branch == branch.branch_id and (train_retried or not r.rolled_back) for r in path]
    if not any(trained):
        return None
    sample = merge_turns([turn_sample(r) for r in path], max_trim_tokens=max_trim_tokens, into=into)
    for (start, end), keep in zip(sample.metadata["tito"]["turn_spans"], trained, strict=True):
        if not keep:
            sample.loss_mask[start:end] = [0] * (end - start)
            sample.rollout_logprobs[start:end] = [0.0] * (end - start)
            if sample.token_versions:  # empty: not recorded (a slice assignment would insert)
                sample.token_versions[start:end] = [-1] * (end - start)
    sample.weight_versions = [v for r, keep in zip(path, trained, strict=True) if keep
                              for v in dict.fromkeys(r.output_versions or [r.weight_version])]
    sample.branch = branch
    return sample


def attach_captures(records: Sequence[TurnRecord], sample: Sample, captures: Sequence[EngineCapture]) -> Sample:
    """Stitch the data of ``captures`` from the records of ``sample``'s path (rolled-back ones
    skipped, as :func:`assemble` does) into ``sample`` (its status final): see
    :func:`miles.rollout.capture.store_captures`."""
    if not captures or "tito" not in sample.metadata:
        return store_captures(sample, captures, {})
    active = records if sample.branch is not None else [r for r in records if not r.rolled_back]
    return store_captures(sample, captures, capture_pieces(active, sample, [c.spec.name for c in captures]))


def capture_pieces(records: Sequence[TurnRecord], merged: Sample, names: Sequence[str]) -> dict[str, list[CapturedPiece]]:
    """Each capture's pieces, one per engine call of each turn, cut to the positions that survive in
    ``merged``.

    A turn's calls reported positions up to its last fed token; its trailing sampled tokens that the
    next turn's prompt replaced (see ``turn_spans``) are not the trajectory's, nor are their rows.
    """
    spans = merged.metadata["tito"]["turn_spans"]
    pieces: dict[str, list[CapturedPiece]] = {name: [] for name in names}
    for record, (_, kept_end) in zip(records, spans, strict=True):
        fed = len(record.input_ids) + len(record.output_ids) - 1
        stop = min(fed, merged.prompt_length + kept_end)
        for name in names:
            got = record.captures.get(name) or []
            if not got:
                pieces[name].append(CapturedPiece(start=0, rows=0, stop=0, payload=None))
            for part in got:
                end = max(part.start, min(part.start + part.rows, stop))
                pieces[name].append(CapturedPiece(start=part.start, rows=part.rows, stop=end, payload=part.payload))
    return pieces


def _sampled_versions(turn: Sample) -> list[int] | None:
    """The version of each token ``turn`` sampled: its own list, else its one call's version on
    every token; None when the turn does not say (no version, or several calls and no list)."""
    if turn.token_versions:
        return list(turn.token_versions)
    if len(set(turn.weight_versions)) == 1:
        return [turn.weight_versions[0]] * turn.response_length
    return None


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

