"""Property: any valid operator input plus ONE mutation is either valid or cleanly refused.

The strategy builds varied valid inputs; a mutation then breaks one thing. Validation must
end in an OperatorInput or in `Refused` whose refusals are well formed, never in another
exception; where the mutation certainly breaks a rule, the expected code must be among them.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from operator_strategies import (  # noqa: F401
    ALIASES,
    BAD_PATHS,
    BOUNDED,
    ENV_VALUES,
    HEX,
    KEYS,
    MUTATIONS,
    PATH_FIELDS,
    SECRET_MARKERS,
    SECRET_VALUE,
    TOOLKITS,
    Doc,
    Expected,
    Loc,
    Mutation,
    _joined,
    _kind,
    _locations,
    _maybe,
    _model_at,
    _node,
    _path,
    abs_paths,
    add_member,
    assert_well_formed,
    bad_commit,
    bad_env_value,
    bad_path,
    commits,
    drop_member,
    environments,
    free_values,
    ggml_names,
    keys,
    one_sided_servers,
    operator_inputs,
    out_of_range,
    pins,
    plans,
    reorder_ladder,
    retype_value,
    secret_env_abbreviation,
    secret_env_name,
    segments,
    sha256s,
    unknown_case,
)

from cache_family.errors import Refused
from cache_family.schemas.operator import (
    OperatorInput,
    validate_operator_document,
    validate_operator_object,
)

# --------------------------------------------------------------------------------------
# Valid inputs


# --------------------------------------------------------------------------------------
# One mutation; each returns the expected (code, path) when it certainly breaks a rule.


# --------------------------------------------------------------------------------------
# Properties


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), doc=operator_inputs())
def test_one_mutation_is_valid_or_cleanly_refused(data: st.DataObject, doc: Doc) -> None:
    mutation = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    expected = mutation(data.draw, doc)
    raw = json.dumps(doc).encode()
    try:
        model = validate_operator_document(raw)
    except Refused as refused:
        assert_well_formed(refused)
        if expected is not None:
            code, path = expected
            if code == "*":  # retyped: refused at that member or inside it
                assert any(r.path == path or r.path.startswith((path + ".", path + "["))
                           for r in refused.refusals), refused  # fmt: skip
            else:
                assert (code, path) in [(r.code, r.path) for r in refused.refusals], refused
        return
    assert expected is None, f"{mutation.__name__} should have been refused: {expected}"
    assert isinstance(model, OperatorInput)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=operator_inputs())
def test_valid_inputs_validate_and_their_dump_revalidates(doc: Doc) -> None:
    model = validate_operator_document(json.dumps(doc).encode())
    dumped = model.model_dump(mode="json")
    for name, value in doc.items():
        if name == "plan":  # the dump adds the optional plan.catalog when it was left out
            assert {k: dumped["plan"][k] for k in value} == value
        else:
            assert dumped[name] == value
    again = validate_operator_object(json.loads(json.dumps(dumped)))
    assert again == model
    assert again.model_dump(mode="json") == dumped


@settings(max_examples=200, deadline=None)
@given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                    max_size=3),
        max_leaves=12,
    )
)  # fmt: skip
def test_arbitrary_json_values_never_raise_anything_but_refused(value: object) -> None:
    try:
        validate_operator_object(value)
    except Refused as refused:
        assert_well_formed(refused)
