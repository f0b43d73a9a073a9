"""Cost profiles: built-ins, validation with clear messages, and the YAML round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.sim.profile import (
    EngineDefaults,
    Profile,
    ProfileError,
    StepCost,
    builtin_profiles,
    dump_profile,
    load_profile,
    profile_from_dict,
)


def doc(**overrides: object) -> dict[str, object]:
    """A valid profile document, with top-level keys replaced."""
    base: dict[str, object] = {
        "name": "t",
        "model": "m",
        "description": "d",
        "step": {"fixed_s": 0.005, "prefill_per_token_s": 1e-5, "decode_per_token_s": 1e-6},
        "engine": {"max_num_batched_tokens": 512},
    }
    base.update(overrides)
    return base


def step_with(**overrides: object) -> dict[str, object]:
    """A valid ``step`` section, with keys replaced or added."""
    return {"fixed_s": 1, "prefill_per_token_s": 1, "decode_per_token_s": 1, **overrides}


def test_builtin_profiles_are_listed_and_load() -> None:
    names = builtin_profiles()
    assert {"h100-llama3-8b", "cpu-tiny"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.name == name
        assert profile.step.fixed_s > 0


def test_h100_profile_holds_the_published_coefficients() -> None:
    profile = load_profile("h100-llama3-8b")
    assert profile.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert profile.step.fixed_s == pytest.approx(5752.705e-6)
    assert profile.step.prefill_per_token_s == pytest.approx(17.2509e-6)
    assert profile.step.decode_per_token_s == pytest.approx(5.99914e-6)
    assert profile.engine == EngineDefaults(
        max_num_batched_tokens=8192,
        max_num_seqs=1024,
        max_model_len=131072,
        block_size=16,
        num_gpu_blocks=29205,
        async_scheduling=True,
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [("h100-llama3-8b", True), ("cpu-tiny", False), ("vllm-cpu-tiny", False)],
)
def test_async_scheduling_default_is_vllm_032s_choice_on_the_profiles_platform(
    name: str, expected: bool
) -> None:
    # vLLM 0.32 turns it on by default on a GPU; its CPU platform always turns it off.
    assert load_profile(name).engine.async_scheduling is expected


def test_default_profile_is_h100() -> None:
    assert load_profile().name == "h100-llama3-8b"


def test_engine_section_is_optional() -> None:
    data = doc()
    del data["engine"]
    assert profile_from_dict(data).engine == EngineDefaults()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (doc(step=step_with(x=1)), r"step: unknown keys \['x'\]"),
        (
            doc(engine={"max_num_batched_token": 512}),
            r"engine: unknown keys \['max_num_batched_token'\]",
        ),
        (doc(colour="red"), r"unknown keys \['colour'\]"),
        (doc(step=step_with(fixed_s=-0.1)), r"step\.fixed_s must be a non-negative number"),
        (doc(step=step_with(fixed_s="fast")), r"step\.fixed_s must be a non-negative number"),
        (doc(step=step_with(fixed_s=float("nan"))), r"step\.fixed_s must be a non-negative number"),
        (
            doc(step=step_with(prefill_per_token_s=float("inf"))),
            r"step\.prefill_per_token_s must be a non-negative number",
        ),
        (doc(step=step_with(fixed_s=True)), r"step\.fixed_s must be a non-negative number"),
        (doc(engine={"max_num_seqs": -4}), r"engine\.max_num_seqs must be a positive integer"),
        (doc(engine={"max_num_seqs": True}), r"engine\.max_num_seqs must be a positive integer"),
        (doc(engine={"block_size": 0}), r"engine\.block_size must be a positive integer"),
        (doc(engine={"async_scheduling": 1}), r"engine\.async_scheduling must be true or false"),
        (doc(engine={"async_scheduling": "yes"}), r"engine\.async_scheduling must be true"),
        (
            doc(engine={"num_gpu_blocks": 10.5}),
            r"engine\.num_gpu_blocks must be a positive integer",
        ),
        (doc(step={"fixed_s": 1, "prefill_per_token_s": 1}), r"step: .*decode_per_token_s"),
        (doc(step=None), r"step: expected a mapping"),
        (doc(step=[1, 2]), r"step: expected a mapping, got list"),
        ({"step": doc()["step"]}, r"name"),
        ([1, 2, 3], r"expected a mapping at top level"),
    ],
)
def test_bad_documents_raise_profile_error_saying_what_is_wrong(data: object, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(data, "my.yaml")


def test_non_finite_yaml_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "nan.yaml"
    path.write_text(
        "name: x\nmodel: y\ndescription: z\n"
        "step: {fixed_s: .nan, prefill_per_token_s: 0, decode_per_token_s: 0}\n"
    )
    with pytest.raises(ProfileError, match=r"step\.fixed_s"):
        load_profile(str(path))


def test_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmodel: y\ndescription: z\nstep:\n  fixed_s: -1\n")
    with pytest.raises(ProfileError, match=r"broken\.yaml"):
        load_profile(str(path))


def test_missing_file_or_unknown_name_lists_the_builtins(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"no profile .*nope\.yaml.*h100-llama3-8b"):
        load_profile(str(tmp_path / "nope.yaml"))
    with pytest.raises(ProfileError, match=r"no profile 'a100'.*cpu-tiny"):
        load_profile("a100")


def test_invalid_yaml_is_a_profile_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(str(path))


def test_profile_error_is_a_value_error() -> None:
    assert issubclass(ProfileError, ValueError)


def test_dump_and_load_round_trip_a_builtin(tmp_path: Path) -> None:
    for name in builtin_profiles():
        profile = load_profile(name)
        path = tmp_path / f"{name}-copy.yaml"
        path.write_text(dump_profile(profile))
        assert load_profile(str(path)) == profile


costs = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)
positive = st.integers(min_value=1, max_value=1 << 20)


@settings(max_examples=50, deadline=None)
@given(
    # Every field of each: a coefficient added to StepCost is round-tripped too.
    step=st.builds(StepCost, **{f.name: costs for f in dataclasses.fields(StepCost)}),
    engine=st.builds(
        EngineDefaults,
        **{
            f.name: st.booleans() if f.name == "async_scheduling" else positive
            for f in dataclasses.fields(EngineDefaults)
        },
    ),
    text=st.text(min_size=0, max_size=40),
)
def test_dump_profile_round_trips_any_valid_profile(
    step: StepCost, engine: EngineDefaults, text: str
) -> None:
    profile = Profile(name="fitted", model=text, description=text, step=step, engine=engine)
    assert profile_from_dict(yaml.safe_load(dump_profile(profile))) == profile
