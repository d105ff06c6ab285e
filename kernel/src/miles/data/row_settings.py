"""Checking a data row's ``settings`` against the run's plugins (``miles_contracts.settings``).

``env`` and ``budget`` are typed by the contracts; ``env.tools`` must name registered tools;
``agent`` is validated by the settings model of the run's agent (``rollout.agent``) and ``reward``
by that of the row's reward (``metadata.reward``, else ``reward.name``). A plugin without a
settings model takes no per-sample settings: a row that gives it some is refused rather than
silently ignored. The first problem is reported with the field's path (``settings.budget.tokens``)
so the data source can name the row and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles_contracts.settings import SETTINGS_KEY, SampleSettings
from pydantic import BaseModel, ValidationError

from miles.data.errors import RecordProblem

if TYPE_CHECKING:
    from miles_contracts import RunContext


class SettingsProblem(RecordProblem):
    """A row's settings fail validation (counted apart from unreadable rows: ``data/rows_invalid``)."""


class RowSettings:
    """The settings check of one run: its tools, its agent's settings model, its rewards'."""

    def __init__(self, ctx: RunContext) -> None:
        config, kernel = ctx.config, ctx.kernel
        self.tools = kernel.tools()
        self.rewards = kernel.rewards()
        self.default_reward = config.reward.name
        self.agent = config.rollout.agent
        self.agent_model = kernel.agents().get(self.agent).settings_model if self.agent else None

    def check(self, fields: Mapping[str, Any], metadata: Mapping[str, Any]) -> dict[str, Any] | None:
        """The row's validated settings, defaults filled in (None: the row sets none and no plugin
        of the run has a settings model). Raises :class:`SettingsProblem` naming the field."""
        if SETTINGS_KEY in metadata:
            raise SettingsProblem("metadata.settings: per-sample settings go in the row's top-level 'settings' field")
        raw = fields.get(SETTINGS_KEY)
        reward_model = self._reward_model(metadata)
        if raw is None and self.agent_model is None and reward_model is None:
            return None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise SettingsProblem(f"settings: expected an object, got {type(raw).__name__}")
        settings: SampleSettings = _validated(SampleSettings, raw, "settings")
        for i, name in enumerate(settings.env.tools or ()):
            if name not in self.tools:
                raise SettingsProblem(f"settings.env.tools[{i}]: {self.tools.unknown_message(name)}")
        agent = self._plugin_settings(settings.agent, self.agent_model, "agent",
                                      f"agent {self.agent!r}" if self.agent else None)
        reward_name = metadata.get("reward", self.default_reward)
        reward = self._plugin_settings(settings.reward, reward_model, "reward", f"reward {reward_name!r}")
        checked: dict[str, Any] = settings.model_copy(update={"agent": agent, "reward": reward}).model_dump(mode="json")
        return checked

    def _reward_model(self, metadata: Mapping[str, Any]) -> type[BaseModel] | None:
        name = metadata.get("reward", self.default_reward)
        # an unknown reward name is reported when the sample is scored (miles.rewards.scoring)
        return self.rewards.get(name).settings_model if isinstance(name, str) and name in self.rewards else None

    @staticmethod
    def _plugin_settings(given: dict[str, Any], model: type[BaseModel] | None, key: str,
                         plugin: str | None) -> dict[str, Any]:
        if model is not None:
            validated: BaseModel = _validated(model, given, f"settings.{key}")
            return validated.model_dump(mode="json")
        if given:
            owner = f"{plugin} takes no per-sample settings (its spec has no settings_model)" if plugin else \
                "this run has no agent (rollout.agent)"
            raise SettingsProblem(f"settings.{key}: {owner}; remove settings.{key} from the row")
        return {}


def _validated(model: type[Any], value: Any, where: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join([where, *(str(p) for p in error["loc"])])
        if error["type"] == "extra_forbidden":
            known = _field_names(model, error["loc"][:-1])
            raise SettingsProblem(f"{path}: not a setting{f' (expected one of {known})' if known else ''}") from None
        raise SettingsProblem(f"{path}: {error['msg']}") from None


def _field_names(model: type[Any], loc: tuple[Any, ...]) -> str:
    """The fields of the (nested) model at ``loc``, for the message about an unknown key."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    return ", ".join(model.model_fields)
