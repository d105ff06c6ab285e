"""Collect one step's training groups: prompts -> generator -> reward -> filters, over-sampling
until the step has ``rollout.prompts_per_step`` kept groups (or gives up after a few rounds, or
after a round in which every sample was aborted).

Results keep the order the prompts were drawn in, whatever order the engine finishes them in
(generators fill the samples in place), so a step's batch does not depend on timing. With
``run.deterministic`` every sample also sends its own ``sampling_seed`` (:func:`sampling_seed`),
so what it samples does not depend on which requests it shared the engine with.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_contracts import DataSource, EngineClient, ExitReason, GenerateContext, RunContext, Sample, Status
from miles_contracts.wire.engine import SamplingParams

from miles.data.row_settings import RowSettings
from miles.data.source import source_metrics
from miles.errors import MilesError
from miles.filtering import apply_filters, over_sampler_for
from miles.loop.episodes import episode_metrics, training_rows
from miles.loop.ledger import Draw, Ledger, regroup
from miles.loop.progress import RolloutProgress
from miles.loop.redo import REDO_ATTEMPTS, REDO_REASON, pristine, spoiled_by_a_fault
from miles.loop.redraw import INVALID_SETTINGS, check_redraws, resized
from miles.rewards import score_samples

MAX_ROUNDS = 4  # over-sampling rounds before a step trains on fewer groups than asked


def sampling_seed(run_seed: int, index: int) -> int:
    """The ``sampling_seed`` of sample ``index`` (unique over the run, restored on resume) in a
    deterministic run: hashed, so that neighbouring seeds or indices give unrelated streams, and
    below 2**31 so that every engine accepts it."""
    digest = hashlib.blake2b(f"miles-sampling:{run_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 2**31


class GeneratorFailingError(MilesError):
    """The generator raised on every one of the last ``rollout.max_generator_failures`` calls."""


class GeneratorFailures:
    """Counts generator calls that raise in a row. A call that raises costs its sample; a
    generator that only raises (an unreachable sandbox, a bug on every path) would cost every
    prompt of the run while the trainer waits for a batch that never comes, so after ``limit`` in
    a row the run stops with the generator's name and its last exception."""

    def __init__(self, generator: str, limit: int) -> None:
        self.generator = generator
        self.limit = limit
        self.in_a_row = 0

    def succeeded(self) -> None:
        self.in_a_row = 0

    def failed(self, exc: Exception) -> None:
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise GeneratorFailingError(
                f"generator {self.generator!r} raised on {self.in_a_row} calls in a row, the last with "
                f"{type(exc).__name__}: {exc}; the run stops (rollout.max_generator_failures: {self.limit})"
            ) from exc


@dataclass
class StepRollout:
    groups: list[list[Sample]]  # kept groups
    all_samples: list[Sample]  # everything generated this step (for dumps and metrics)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def train_samples(self) -> list[Sample]:
        """The step's training rows: each kept episode's trainable rows (:func:`training_rows`)."""
        return training_rows(self.groups)


class RolloutManager:
    """Draws prompts, runs the generator on them and scores them, in the driver.

    :param ctx: the driver's run context (config, kernel).
    :param partial_rollout: generations a weight update aborts go on under the new weights
        (:attr:`GenerateContext.partial_rollout`); the loop mode decides.
    :param ledger: the run's sample ledger, told what becomes of every training prompt drawn
        (:mod:`miles.loop.ledger`); None records nothing (``miles rollout``, tests).
    """

    def __init__(self, ctx: RunContext, data: DataSource, engine: EngineClient, tokenizer: Any,
                 session_url: str | None = None, *, partial_rollout: bool = False,
                 ledger: Ledger | None = None, service_urls: Mapping[str, Sequence[str]] | None = None) -> None:
        self.run = ctx
        self.config = ctx.config
        self.kernel = ctx.kernel
        self.data = data
        self.generator = ctx.kernel.generators().get(ctx.config.rollout.generator).generate
        self.failures = GeneratorFailures(ctx.config.rollout.generator, ctx.config.rollout.max_generator_failures)
        self.engine = engine
        self.tokenizer = tokenizer
        self.session_url = session_url
        self.service_urls = dict(service_urls or {})
        self.partial_rollout = partial_rollout
        self.over_sampler = over_sampler_for(ctx.config.rollout.over_sampling)
        self.captures = ctx.kernel.engine_captures(ctx)
        self.ledger = ledger
        self._next_group = 0
        self._next_index = 0
        self._redraw: deque[Draw] = deque()  # prompts in flight at the checkpoint a run resumed from
        # evaluation numbers its samples apart: an evaluation between two steps must not shift the
        # indices (the run.deterministic sampling seeds) of the training samples after it
        self._next_eval = [0, 0]  # group, index

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"next_group": self._next_group, "next_index": self._next_index, "next_eval": list(self._next_eval),
                "over_sampler": self.over_sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_group, self._next_index = state["next_group"], state["next_index"]
        self._next_eval = list(state.get("next_eval", [0, 0]))  # absent in checkpoints of before
        self.over_sampler.load_state_dict(state["over_sampler"])

    def redraw(self, draws: Sequence[Draw]) -> None:
        """Draw these again (with their ids) before any new prompt: they were in flight at the
        checkpoint the run resumed from, past the data position it saved. Their settings are
        checked as the data source checks a row's (:mod:`miles.loop.redraw`)."""
        if not draws:
            return
        valid, invalid = check_redraws(draws, RowSettings(self.run), self.config.data.on_error)
        for group in map(regroup, invalid):  # data.on_error: skip
            self.record([group], "drawn", reason="resumed")
            self.record([group], "dropped", reason=INVALID_SETTINGS)
        self._redraw.extend(valid)

    # ------------------------------------------------------------------ the ledger

    def redraw_groups(self) -> set[int]:
        """The groups a resume must still draw again (held here until then)."""
        return {d.group for d in self._redraw}

    def record(self, groups: Sequence[Sequence[Sample]], state: str, *, reason: str | None = None,
               step: int | None = None) -> None:
        """Tell the ledger (when there is one) that each of ``groups`` is now ``state``."""
        if self.ledger is not None:
            for group in groups:
                self.ledger.record(group, state, reason=reason, step=step)

    # ------------------------------------------------------------------ training rollouts

    def draw_groups(self, count: int) -> list[list[Sample]]:
        """``count`` training prompt groups of ``rollout.samples_per_prompt`` samples: first the
        prompts a resume must draw again, then new ones from the data source; recorded as drawn."""
        again = []
        for _ in range(min(count, len(self._redraw))):  # at the group size the run has now
            group, self._next_index = resized(regroup(self._redraw.popleft()), self.config.rollout.samples_per_prompt,
                                              self._next_index)
            again.append(group)
        fresh = self.make_groups(self.data.next_prompts(count - len(again)), self.config.rollout.samples_per_prompt) \
            if count > len(again) else []
        self.record(again, "drawn", reason="resumed")
        self.record(fresh, "drawn")
        return again + fresh


    def sampling_params(self, *, evaluation: bool = False) -> SamplingParams:
        r = self.config.rollout
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, stop=r.stop or None)
        if evaluation:
            e = self.config.eval
            params = params.model_copy(update={
                "max_new_tokens": e.max_new_tokens or r.max_new_tokens,
                **({"temperature": 0.0, "top_p": 1.0, "top_k": -1} if e.greedy else {}),
            })
        return params

    def context(self, *, evaluation: bool = False) -> GenerateContext:
        # weights may change under evaluations too (fully_async evaluates while training goes on)
        return GenerateContext(
            engine=self.engine, tokenizer=self.tokenizer, sampling_params=self.sampling_params(evaluation=evaluation),
            max_context_len=self.config.rollout.max_context_len, run=self.run, session_server_url=self.session_url,
            service_urls=self.service_urls,
            evaluation=evaluation, captures=() if evaluation else tuple(self.captures),
            partial_rollout=self.partial_rollout,
        )

    def make_groups(self, prompts: Sequence[Sample], n: int, *, evaluation: bool = False) -> list[list[Sample]]:
        """``n`` copies of each prompt, numbered (``group_index``, ``index``) by the training
        counters, or with ``evaluation`` by the evaluation's own."""
        group_no, index = self._next_eval if evaluation else [self._next_group, self._next_index]
        groups = []
        for prompt in prompts:
            group = []
            for _ in range(n):
                s = copy.deepcopy(prompt)
                s.group_index, s.index = group_no, index
                index += 1
                group.append(s)
            group_no += 1
            groups.append(group)
        if evaluation:
            self._next_eval = [group_no, index]
        else:
            self._next_group, self._next_index = group_no, index
        return groups

    async def generate_one(self, sample: Sample, ctx: GenerateContext) -> None:
        """Run the generator on ``sample``. One that raises costs the sample (FAILED), not the run,
        unless it raised on every one of the last ``rollout.max_generator_failures`` calls: then
        :class:`GeneratorFailingError`."""
        try:
            await self.generator(sample, self._seeded(ctx, sample))
        except Exception as exc:
            sample.finish(Status.FAILED, ExitReason.ENGINE_ERROR, f"generator raised {type(exc).__name__}: {exc}")
            self.failures.failed(exc)
        else:
            self.failures.succeeded()

    async def generate(self, samples: list[Sample], ctx: GenerateContext,
                       on_done: Callable[[int], None] | None = None) -> None:
        limit = asyncio.Semaphore(self.config.rollout.concurrency)
        done = 0

        async def one(sample: Sample) -> None:
            nonlocal done
            async with limit:
                await self.generate_one(sample, ctx)
            done += 1
            if on_done:
                on_done(done)

        await asyncio.gather(*(one(s) for s in samples))

    def _seeded(self, ctx: GenerateContext, sample: Sample) -> GenerateContext:
        if not self.config.run.deterministic:
            return ctx
        seed = sampling_seed(self.config.run.seed, sample.index)
        return dataclasses.replace(ctx, sampling_params=ctx.sampling_params.model_copy(update={"sampling_seed": seed}))

    async def collect(self, step: int, progress: Callable[[RolloutProgress], None] | None = None, *,
                      recover: Callable[[], Awaitable[None]] | None = None) -> StepRollout:
        """Step ``step``'s kept groups. ``recover`` waits until every service serves again with the
        trainer's weights; given it, a ``run.deterministic`` run redoes in place each group a dead
        service spoiled (:mod:`miles.loop.redo`) before the filters see it."""
        r = self.config.rollout
        redo = recover if self.config.run.deterministic else None
        wanted = r.prompts_per_step
        kept: list[list[Sample]] = []
        everything: list[Sample] = []
        drops: Counter[str] = Counter()
        reward_metrics: Counter[str] = Counter()
        generated_groups = groups_redone = 0
        start = time.perf_counter()
        ctx = self.context()
        for round_no in range(1, MAX_ROUNDS + 1):
            draw = self.over_sampler.groups_to_draw(wanted - len(kept))
            if draw == 0:
                break
            groups = self.draw_groups(draw)
            samples = [s for g in groups for s in g]
            # the total grows by this round's samples: reported at once, with why (RolloutProgress.note)
            round_start = RolloutProgress(done=len(everything), total=len(everything) + len(samples), round=round_no,
                                          groups_drawn=generated_groups + len(groups), groups_wanted=wanted,
                                          groups_kept=len(kept))
            if progress is not None:
                progress(round_start)
            as_drawn = pristine(groups) if redo is not None else []
            self.record(groups, "in_flight")
            await self.generate(samples, ctx, _reporter(progress, round_start))
            report = await score_samples(samples, self.run)
            self.record(groups, "generated")
            reward_metrics.update(report.metrics())
            if redo is not None:
                spoiled, redone = await self._redo_in_place(groups, as_drawn, ctx, redo)
                everything += spoiled  # in the step's dump, for the post-mortem; never trained
                groups_redone += redone
                samples = [s for g in groups for s in g]
            everything += samples
            generated_groups += len(groups)
            if all(s.status is Status.ABORTED for s in samples):
                # nothing came back (the engines are gone or restarting): drawing more prompts would
                # only abort them too, and teach the over-sampler a keep rate of 0
                drops["all_aborted"] += len(groups)
                self.record(groups, "dropped", reason="all_aborted")
                break
            survivors = self._filter(groups, drops)
            self.over_sampler.observe(drawn=len(groups), kept=len(survivors))
            kept += survivors
        surplus = max(0, len(kept) - wanted)
        self.record(kept[wanted:], "dropped", reason="surplus")
        kept = kept[:wanted]
        metrics = rollout_metrics(everything, kept, drops, generated_groups, surplus, time.perf_counter() - start)
        metrics.update(reward_metrics)
        if redo is not None:
            metrics["rollout/groups_redone"] = float(groups_redone)
        metrics.update(self.over_sampler.metrics())
        metrics.update(source_metrics(self.data))
        return StepRollout(kept, everything, metrics)

    async def _redo_in_place(self, groups: list[list[Sample]], as_drawn: list[list[Sample]], ctx: GenerateContext,
                             recover: Callable[[], Awaitable[None]]) -> tuple[list[Sample], int]:
        """Generate again, from their copies as drawn (same ids, same seeds), the groups of
        ``groups`` a dead service spoiled, once ``recover`` says the services are back; at most
        :data:`~miles.loop.redo.REDO_ATTEMPTS` times. Replaces them in ``groups``; returns the
        spoiled samples and how many group generations were redone."""
        spoiled_samples: list[Sample] = []
        redone = 0
        for _ in range(REDO_ATTEMPTS):
            spoiled = [i for i, group in enumerate(groups) if spoiled_by_a_fault(group)]
            if not spoiled:
                break
            self.record([groups[i] for i in spoiled], "recycled", reason=REDO_REASON)
            await recover()
            for i in spoiled:
                spoiled_samples += groups[i]
                groups[i] = pristine([as_drawn[i]])[0]  # as_drawn stays untouched for a further attempt
            again = [groups[i] for i in spoiled]
            samples = [s for g in again for s in g]
            self.record(again, "in_flight")
            await self.generate(samples, ctx)
            await score_samples(samples, self.run)
            self.record(again, "generated")
            redone += len(spoiled)
        return spoiled_samples, redone

    def _filter(self, groups: list[list[Sample]], drops: Counter[str]) -> list[list[Sample]]:
        """The groups every ``rollout.filters`` keeps; each dropped one counted in ``drops`` and
        recorded in the ledger under its reason (filters judge each group on its own)."""
        survivors = []
        for group in groups:
            kept, dropped = apply_filters([group], self.config.rollout.filters, self.kernel)
            if kept:
                survivors.append(group)
            else:
                reason = next(iter(dropped))
                drops[reason] += 1
                self.record([group], "filtered", reason=reason)
        return survivors

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self, prompts: Sequence[Sample]) -> tuple[list[Sample], dict[str, float]]:
        from miles.evaluation import evaluation_metrics

        k = self.config.eval.samples_per_prompt
        groups = self.make_groups(prompts, k, evaluation=True)
        samples = [s for g in groups for s in g]
        await self.generate(samples, self.context(evaluation=True))
        await score_samples(samples, self.run)
        return samples, {f"eval/{name}": value for name, value in evaluation_metrics(groups, k).items()}


def _reporter(progress: Callable[[RolloutProgress], None] | None,
              round_start: RolloutProgress) -> Callable[[int], None] | None:
    """``on_done(finished)`` for :meth:`RolloutManager.generate`: reports ``round_start`` with
    ``finished`` more samples done (None without a ``progress`` callback)."""
    if progress is None:
        return None

    def on_done(finished: int) -> None:
        progress(dataclasses.replace(round_start, done=round_start.done + finished))

    return on_done


def rollout_metrics(samples: list[Sample], kept: list[list[Sample]], drops: Counter[str],
                    generated_groups: int, surplus: int, seconds: float) -> dict[str, float]:
    rewards = [s.reward for s in samples if s.reward is not None and not math.isnan(s.reward)]
    lengths = [s.response_length for s in samples]
    statuses = Counter(s.status.value for s in samples)
    tokens = sum(lengths)
    m: dict[str, float] = {
        "rollout/samples": float(len(samples)),
        "rollout/groups_generated": float(generated_groups),
        "rollout/groups_kept": float(len(kept)),
        "rollout/groups_surplus": float(surplus),
        "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "rollout/accuracy": sum(r > 0.5 for r in rewards) / len(rewards) if rewards else float("nan"),
        "rollout/response_len_mean": tokens / len(lengths) if lengths else 0.0,
        "rollout/response_len_max": float(max(lengths, default=0)),
        "rollout/truncated_frac": statuses.get(Status.TRUNCATED.value, 0) / max(len(samples), 1),
        "perf/rollout_tokens": float(tokens),
        "perf/rollout_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "time/rollout": seconds,
    }
    for status, count in statuses.items():
        m[f"rollout/status_{status}"] = float(count)
    # why samples could not be trained on (e.g. exit_missing_capture: an engine capture was absent)
    dropped = Counter(s.exit_reason.value for s in samples
                      if s.exit_reason is not None and s.status in (Status.FAILED, Status.ABORTED))
    for reason, count in dropped.items():
        m[f"rollout/exit_{reason}"] = float(count)
    for reason, count in drops.items():
        m[f"filter/drop_{reason}"] = float(count)
    m.update(tool_call_metrics(samples))
    m.update(episode_metrics(samples))
    return m


def tool_call_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """``rollout/tool_calls`` (calls the parser read) and ``rollout/tool_calls_malformed`` (calls it
    could not read, kept as text), from ``metadata["tool_calls"]`` of the samples a session recorded;
    empty when none did, so runs without tool calls log the keys they always did."""
    counted = [s.metadata["tool_calls"] for s in samples if isinstance(s.metadata.get("tool_calls"), dict)]
    if not counted:
        return {}
    return {"rollout/tool_calls": float(sum(int(c.get("parsed", 0)) for c in counted)),
            "rollout/tool_calls_malformed": float(sum(int(c.get("malformed", 0)) for c in counted))}
