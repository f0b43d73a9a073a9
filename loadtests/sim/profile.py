"""Cost profiles: the coefficients of the step-time model, and engine defaults.

A profile is a YAML data file. Built-in profiles live in ``loadtests/sim/profiles/``
and are found by name; any other path to a YAML file works too, so a profile
fitted to a real engine can be dropped in without touching code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

DEFAULT_PROFILE = "h100-llama3-8b"


class ProfileError(ValueError):
    """A profile is missing, unreadable or has a bad value."""


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Step time = fixed + prefill part + decode part (all in seconds).

    - ``fixed_s``: paid by every step (weights read, launch, scheduling).
    - ``prefill_per_token_s``: per prompt token computed in the step.
    - ``prefill_attention_per_token_context_s``: per prompt token per token of
      context before it (the quadratic part of attention over long prompts).
    - ``decode_per_token_s``: per decoding sequence in the step.
    - ``decode_per_context_token_s``: per token of context the decoding sequences
      attend to (KV-cache reads).
    - ``decode_step_overhead_s``: paid once by a step that has any decode
      (sampling and output processing).
    """

    fixed_s: float
    prefill_per_token_s: float
    decode_per_token_s: float
    prefill_attention_per_token_context_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    decode_step_overhead_s: float = 0.0

    def scaled(self, k: float) -> StepCost:
        """Every part ``k`` times as long (``k`` 2: a card half as fast)."""
        return StepCost(**{f.name: getattr(self, f.name) * k for f in fields(self)})


@dataclass(frozen=True, kw_only=True)
class EngineDefaults:
    """Engine settings a profile suggests; command-line flags override them.

    ``async_scheduling`` is what vLLM chooses on the profile's platform when not told
    (see docs/simulator.md); a profile that does not say runs without it.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    block_size: int = 16
    num_gpu_blocks: int = 8192
    async_scheduling: bool = False


@dataclass(frozen=True, kw_only=True)
class Activation:
    """How long vLLM's sleep mode takes on the profile's card, in seconds: level 1
    offloads the weights to CPU memory and drops the KV cache (waking copies them
    back); level 2 drops both (waking loads the weights again)."""

    sleep_level1_s: float = 0.5
    wake_level1_s: float = 1.0
    sleep_level2_s: float = 0.2
    wake_level2_s: float = 5.0

    def sleep_s(self, level: int) -> float:
        return self.sleep_level1_s if level == 1 else self.sleep_level2_s

    def wake_s(self, level: int) -> float:
        return self.wake_level1_s if level == 1 else self.wake_level2_s


@dataclass(frozen=True, kw_only=True)
class Profile:
    name: str
    model: str
    description: str
    step: StepCost
    engine: EngineDefaults = field(default_factory=EngineDefaults)
    activation: Activation = field(default_factory=Activation)


def _build(cls: type[Any], data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ProfileError(f"{where}: {exc}") from exc


def profile_from_dict(data: Any, where: str = "profile") -> Profile:
    """Validate a parsed profile document and build a :class:`Profile`."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping at top level")
    body = dict(data)
    step = _build(StepCost, body.pop("step", None), f"{where}: step")
    engine = _build(EngineDefaults, body.pop("engine", {}), f"{where}: engine")
    activation = _build(Activation, body.pop("activation", {}), f"{where}: activation")
    for key, value in vars(activation).items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0:
            raise ProfileError(f"{where}: activation.{key} must be a non-negative number")
    for key, value in vars(step).items():
        # bool is an int, and YAML reads .nan and .inf as floats: none is a cost.
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0:
            raise ProfileError(f"{where}: step.{key} must be a non-negative number")
    for key, value in vars(engine).items():
        if key == "async_scheduling":
            if not isinstance(value, bool):
                raise ProfileError(f"{where}: engine.{key} must be true or false")
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ProfileError(f"{where}: engine.{key} must be a positive integer")
    parts = {"step": step, "engine": engine, "activation": activation}
    profile: Profile = _build(Profile, {**body, **parts}, where)
    return profile


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    folder = resources.files("loadtests.sim") / "profiles"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> Profile:
    """Load a built-in profile by name, or a profile file by path."""
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"} and path.exists():
        text = path.read_text()
    elif name_or_path in builtin_profiles():
        text = (resources.files("loadtests.sim") / "profiles" / f"{name_or_path}.yaml").read_text()
    else:
        raise ProfileError(
            f"no profile {name_or_path!r}: give a YAML file or one of {builtin_profiles()}"
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{name_or_path}: not valid YAML: {exc}") from exc
    return profile_from_dict(data, name_or_path)


def dump_profile(profile: Profile) -> str:
    """Serialise a profile as YAML (used by calibration to write fitted profiles)."""
    doc = {
        "name": profile.name,
        "model": profile.model,
        "description": profile.description,
        "step": vars(profile.step),
        "engine": vars(profile.engine),
    }
    return yaml.safe_dump(doc, sort_keys=False)
