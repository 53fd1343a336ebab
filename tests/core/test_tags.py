"""Tag taxonomy: packing, bounds, temporal buckets, bad input."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from agentkv.tags import (
    NUM_TAG_CODES,
    Modality,
    ModalityName,
    Role,
    RoleName,
    Tag,
    TagCode,
    Temporal,
    TemporalName,
)

ALL_TAGS = [Tag(r, m, t) for r, m, t in itertools.product(Role, Modality, Temporal)]


def test_num_tag_codes_fits_uint8_and_covers_every_tag():
    assert NUM_TAG_CODES == 64
    codes = [t.code for t in ALL_TAGS]
    assert len(set(codes)) == len(ALL_TAGS) == len(Role) * len(Modality) * len(Temporal)
    assert min(codes) == 0
    assert max(codes) < NUM_TAG_CODES <= 256
    # the per-token tag tensor is uint8: codes survive the cast unchanged
    assert list(bytes(codes)) == codes


@pytest.mark.parametrize("tag", ALL_TAGS, ids=lambda t: t.name)
def test_pack_unpack_round_trip(tag: Tag):
    code = TagCode.pack(tag.role, tag.modality, tag.temporal)
    assert code == tag.code
    back = TagCode.unpack(code)
    assert back == tag
    assert isinstance(back.role, Role)
    assert isinstance(back.modality, Modality)
    assert isinstance(back.temporal, Temporal)
    assert TagCode.role_of(code) is tag.role
    assert TagCode.name(code) == tag.name
    for t in Temporal:
        moved = TagCode.with_temporal(code, t)
        assert TagCode.unpack(moved) == Tag(tag.role, tag.modality, t)


def test_pack_defaults_and_layout():
    assert TagCode.pack(Role.OBS) == TagCode.pack(Role.OBS, Modality.TEXT, Temporal.CURRENT) == 5
    # documented layout: role | modality << 3 | temporal << 4
    assert TagCode.pack(Role.OBS, Modality.IMAGE, Temporal.TURN_M1) == 5 | 1 << 3 | 1 << 4
    assert Tag(Role.OBS, Modality.IMAGE, Temporal.TURN_M1).name == "obs/image/turn_m1"
    assert Tag(Role.DELIM).name == "delim/text/current"


@pytest.mark.parametrize("code", [-1, NUM_TAG_CODES, NUM_TAG_CODES + 1, 1 << 20])
def test_unpack_out_of_range_raises(code: int):
    with pytest.raises(ValueError, match=r"tag code must be in \[0, 64\)"):
        TagCode.unpack(code)


def test_codes_in_range_with_an_undefined_role_raise():
    # role bits 7 are free: no Role has value 7
    bad = [c for c in range(NUM_TAG_CODES) if c & 7 == 7]
    assert bad
    for code in bad:
        with pytest.raises(ValueError):
            TagCode.unpack(code)
        with pytest.raises(ValueError):
            TagCode.role_of(code)
        with pytest.raises(ValueError):
            TagCode.name(code)


@pytest.mark.parametrize(
    "args",
    [
        (7, 0, 0),
        (-1, 0, 0),
        (Role.USER, 2, 0),
        (Role.USER, -1, 0),
        (Role.USER, 0, 4),
        (Role.USER, 0, 9),
    ],
)
def test_pack_rejects_values_that_would_spill_into_other_axes(args):
    with pytest.raises(ValueError):
        TagCode.pack(*args)


@given(st.integers(min_value=0, max_value=NUM_TAG_CODES - 1))
def test_every_valid_code_round_trips(code: int):
    if code & 7 == 7:
        return
    tag = TagCode.unpack(code)
    assert tag.code == code


@pytest.mark.parametrize(
    "age, bucket",
    [
        (0, Temporal.CURRENT),
        (1, Temporal.TURN_M1),
        (2, Temporal.TURN_M2),
        (3, Temporal.OLDER),
        (4, Temporal.OLDER),
        (1000, Temporal.OLDER),
    ],
)
def test_temporal_from_age(age: int, bucket: Temporal):
    assert Temporal.from_age(age) is bucket


def test_temporal_from_negative_age_raises():
    with pytest.raises(ValueError, match="turn age must be >= 0, got -1"):
        Temporal.from_age(-1)


def test_temporal_buckets_of_a_conversation():
    """Turns 0..5, current turn 5: the last three turns get their own bucket, the rest OLDER."""
    current = 5
    buckets = [Temporal.from_age(current - turn) for turn in range(current + 1)]
    assert buckets == [Temporal.OLDER] * 3 + [Temporal.TURN_M2, Temporal.TURN_M1, Temporal.CURRENT]


@pytest.mark.parametrize(
    "adapter_type, enum", [(RoleName, Role), (ModalityName, Modality), (TemporalName, Temporal)]
)
def test_wire_names(adapter_type, enum):
    ta = TypeAdapter(adapter_type)
    for member in enum:
        name = member.name.lower()
        assert ta.dump_python(member) == name
        assert ta.validate_python(name) is member
        assert ta.validate_python(name.upper()) is member
        assert ta.validate_python(member) is member
    assert ta.json_schema() == {"type": "string", "enum": [m.name.lower() for m in enum]}
    with pytest.raises(ValueError, match=f"unknown {enum.__name__.lower()} 'nope'"):
        ta.validate_python("nope")
    with pytest.raises(ValueError, match="must be a name string"):
        ta.validate_python(0)  # ints are not accepted on the wire: names only
