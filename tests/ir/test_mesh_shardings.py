"""Shardings over named mesh axes (`{mesh['x'=2,'y'=4], [{'x'}, {}]}`, XLA's "HloShardingV3"), which
jaxlib 0.12's XLA writes in its dumps.

The IR must print them back unchanged and read each as the tile assignment XLA converts it to
(`HloSharding.v3_to_v2_sharding`, which jaxlib 0.10.2's XLA has too), and refuse what XLA's
NamedSharding aborts the process on.
"""

import pytest

import hlo_tools
from hlo_tools.ir.attributes import Sharding
from hlo_tools.xla import xla_bridge

MESH_SHARDINGS = [
    "{mesh['data'=8], [{'data'}, {}]}",
    "{mesh['data'=8], [{}, {}]}",
    "{mesh['data'=8], replicated}",
    "{mesh['data'=8], manual}",
    "{mesh[], replicated}",
    "{mesh['x'=2], []}",
    "{mesh['x'=1], [{'x'}]}",
    "{mesh['x'=2,'y'=4], [{'x'}, {'y'}]}",
    "{mesh['x'=2,'y'=4], [{'y'}, {'x'}]}",
    "{mesh['x'=2,'y'=4], [{'y', 'x'}, {}]}",
    "{mesh['x'=2,'y'=4], [{'x', ?}, {?}]}",
    "{mesh['x'=2,'y'=4], [{'x'}, {}], replicated={'y'}}",
    "{mesh['x'=2,'y'=4], [{'x'}, {}], manual={'y'}}",
    "{mesh['x'=2,'y'=4], [{}, {}], manual={'x', 'y'}}",
    "{mesh['x'=2,'y'=1], [{'x'}], manual={'y'}}",
    "{mesh['a'=1], [{}], manual={'a'}}",
    "{mesh['a'=1,'b'=2], [{}], manual={'a'}}",
    "{mesh['a'=1,'b'=2], [{}], unreduced={'a'}, manual={'b'}}",
    "{mesh['a'=1,'b'=2], [{}], unreduced={'b'}, manual={'a'}}",
    "{mesh['a'=1,'b'=1], [{}], unreduced={'a'}, manual={'b'}}",
    "{mesh['x'=2,'y'=2,'z'=2], [{'z'}, {}], unreduced={'y'}, manual={'x'}}",
    "{mesh['x'=4,'y'=2], [{'x':(2)2}, {'y'}]}",
    "{mesh['x'=8], [{'x':(4)2, 'x':(1)2}]}",
    "{mesh['x'=8,'y'=2], [{'x':(2)2}, {'y'}], replicated={'x':(1)2}, unreduced={'x':(4)2}}",
    "{mesh['a'=2,'b'=3,'c'=4], [{'c':(2)2, 'a'}, {'b'}], manual={'c':(1)2}}",
    "{mesh['x'=2,'y'=4], device_ids=(0,4,1,5,2,6,3,7), [{'y'}, {'x'}]}",
    "{mesh['x'=2,'y'=4], device_ids=(7,6,5,4,3,2,1,0), [{'x'}, {}]}",
    "{mesh['x'=2,'y'=2,'z'=2], device_ids=(7,6,5,4,3,2,1,0), [{}, {}], manual={'x', 'z'}}",
    "{mesh['a'=2,'b'=3,'c'=4], device_ids=(23,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,0), "
    "[{'c':(2)2, 'a'}, {'b'}], manual={'c':(1)2}}",
    "{maximal_mesh[device_id=3]}",
    "{mesh['x'=2], [{'x'}], metadata={{op_name=\"a\"}, {op_type=\"b\"}}}",
    "{{mesh['x'=2], manual}, {mesh['x'=2], [{'x'}]}, {replicated}}",
]


def tile_assignment(sharding: Sharding):
    """What `xla_bridge.describe_sharding` gives for XLA's reading of the same sharding."""
    if sharding.kind == "tuple":
        return ("tuple", [tile_assignment(e) for e in sharding.elements])
    if sharding.kind == "maximal":
        return ("maximal", sharding.device)
    if sharding.kind == "tiled":
        subgroups = len(sharding.last_tile_dims) + sharding.last_tile_dim_replicate
        return ("tiled", list(sharding.tile_dims), sharding.device_list(), subgroups)
    return (sharding.kind,)


@pytest.mark.parametrize("text", MESH_SHARDINGS)
def test_mesh_shardings_read_as_the_tile_assignments_xla_converts_them_to(text):
    sharding = Sharding.parse(text)
    assert str(sharding) == text
    assert tile_assignment(sharding) == xla_bridge.describe_sharding(text)


@pytest.mark.parametrize("text, kind, tile_dims, subgroups", [
    ("{mesh['x'=2,'y'=4], [{'x'}, {}], replicated={'y'}}", "tiled", (2, 1, 4), "last_tile_dim_replicate"),
    ("{mesh['x'=2,'y'=4], [{'x'}, {}], unreduced={'y'}}", "tiled", (2, 1, 4), ("unreduced",)),
    ("{mesh['x'=2,'y'=2,'z'=2], [{'x'}, {}], manual={'y'}}", "tiled", (2, 1, 2, 2), ("manual", "replicated")),
    ("{mesh['x'=2,'y'=2,'z'=2], [{}, {}], unreduced={'x'}}", "tiled", (1, 1, 2, 4), ("unreduced", "replicated")),
    ("{mesh['x'=2,'y'=2,'z'=2], [{'z'}, {}], manual={'x'}, unreduced={'y'}}", "tiled", (2, 1, 2, 2),
     ("manual", "unreduced")),
    ("{mesh['x'=2,'y'=4], unreduced}", "unreduced", (), ()),
    ("{mesh['x'=2,'y'=4], [{}, {}], unreduced={'x', 'y'}}", "unreduced", (), ()),
    ("{mesh['a'=1,'b'=1], [{}], replicated={'b'}, unreduced={'a'}}", "unreduced", (), ()),
    ("{mesh['a'=1,'b'=2], [{}], unreduced={'b'}, manual={'a'}}", "tiled", (1, 2), ("unreduced",)),
    ("{single_device[device_id=3]}", "maximal", (), ()),
])
def test_subgroups_are_xlas(text, kind, tile_dims, subgroups):
    """The subgroup dimensions and their order as XLA's V2 text of each has them
    (`{devices=[2,1,2,2]<=[8] last_tile_dims={manual, replicated}}`, ...); `{unreduced}` and
    jaxlib 0.12's `single_device`, which `describe_sharding` cannot compare, by hand."""
    sharding = Sharding.parse(text)
    assert (sharding.kind, sharding.tile_dims) == (kind, tile_dims)
    if subgroups == "last_tile_dim_replicate":
        assert sharding.last_tile_dim_replicate and not sharding.last_tile_dims
    else:
        assert sharding.last_tile_dims == subgroups and not sharding.last_tile_dim_replicate
    assert sharding.device == (3 if kind == "maximal" else None)
    assert str(sharding) == text


MODULE = """HloModule sharded, num_partitions=8

ENTRY %main (p: f32[8,4], q: f32[8,4]) -> (f32[8,4], f32[8,4]) {
  %p = f32[8,4]{1,0} parameter(0), sharding=SHARDING
  %q = f32[8,4]{1,0} parameter(1), sharding={mesh['x'=2,'y'=4], device_ids=(7,6,5,4,3,2,1,0), [{'y'}, {'x'}]}
  ROOT %t = (f32[8,4]{1,0}, f32[8,4]{1,0}) tuple(%p, %q), sharding=ROOT_SHARDING
}
""".replace("ROOT_SHARDING", "{{mesh['x'=2,'y'=4], [{'x'}, {}], replicated={'y'}}, {mesh['x'=2,'y'=4], manual}}")


def test_a_module_with_mesh_shardings_prints_back_and_means_the_same_to_xla():
    text = MODULE.replace("SHARDING", "{mesh['x'=2,'y'=4], [{'x', 'y'}, {}], metadata={{op_name=\"p\"}}}")
    module = hlo_tools.parse_module(text)
    assert module.to_text() == text
    hlo_tools.verify(module)
    regenerated = module.to_text(regenerate=True)
    assert "sharding={mesh['x'=2,'y'=4], device_ids=(7,6,5,4,3,2,1,0), [{'y'}, {'x'}]}" in regenerated
    assert xla_bridge.same_meaning(regenerated, text)
    p = module.entry.parameter(0).attrs["sharding"]
    assert (p.kind, p.tile_dims, p.device_list()) == ("tiled", (8, 1), list(range(8)))


@pytest.mark.parametrize("sharding, says", [
    ("{mesh['x'=2,'x'=2], [{'x'}, {}]}", "two axes named 'x'"),
    ("{mesh['x'=2,'y'=4], device_ids=(0,1,2,3,4,5,6,7), [{'x'}, {}]}", "must reorder the devices"),
    ("{mesh['x'=2,'y'=4], device_ids=(0,1,2,3,4,5,6,6), [{'x'}, {}]}", "must reorder the devices"),
    ("{mesh['x'=2,'y'=4], device_ids=(1,0), [{'x'}, {}]}", "needs 8 device ids, has 2"),
    ("{mesh['x'=2,'y'=4], [{'z'}, {}]}", "no mesh axis 'z'"),
    ("{mesh['x'=2,'y'=4], [{'x'}, {'x'}]}", "overlap"),
    ("{mesh['x'=2,'y'=4], [{'x'}, {}], replicated={'x'}}", "overlap"),
    ("{mesh['x'=8,'y'=1], [{'x':(1)4, 'x':(2)2}, {}]}", "overlap"),
    ("{mesh['x'=8,'y'=1], [{'x':(1)2, 'x':(2)2}, {}]}", "make one axis"),
    ("{mesh['x'=8,'y'=1], [{}, {}], replicated={'x':(1)2, 'x':(2)2}}", "make one axis"),
    ("{mesh['x'=2,'y'=4], [{}, {}], replicated={'y', 'x'}}", "mesh order"),
    ("{mesh['x'=8,'y'=1], [{'x':(3)2}, {}]}", "no part of an axis of size 8"),
    ("{mesh['x'=8,'y'=1], [{'x':(1)8}, {}]}", "no part of an axis of size 8"),
    ("{mesh['x'=8,'y'=1], [{'x':(1)1}, {}]}", "no part of an axis of size 8"),
    ("{mesh['x'=2,'y'=4], [{'x', ?, 'y'}, {}]}", "malformed mesh sharding"),
    ("{mesh['x'=2,'y'=4]}", "malformed mesh sharding"),
    ("{mesh[x=2,y=4], [{}, {}]}", "expects mesh axes like 'x'=2"),
])
def test_what_xla_aborts_on_is_a_parse_error(sharding, says):
    with pytest.raises(hlo_tools.HloParseError, match="mesh") as error:
        hlo_tools.parse_module(MODULE.replace("SHARDING", sharding))
    assert says in error.value.message
    assert (error.value.line, error.value.column) == (4, 45)
