"""hlo_tools.ir.sdy: one reader of Shardy's sharding attributes for every pass."""
from hlo_tools.ir import sdy

MESHES = '{mesh = #sdy.mesh<["data"=2, "model"=4]>, other = #sdy.mesh<["x"=2], device_ids=[1,0]>}'
PER_VALUE = '#sdy.sharding_per_value<[<@mesh, [{"data"}, {}]>, <@mesh, [{}, {"model", "data"}], replicated={"x"}>]>'


def test_meshes_give_axes_sizes_and_coordinates():
    meshes = sdy.meshes(MESHES)
    assert meshes["mesh"].axes == ["data", "model"] and meshes["mesh"].sizes == [2, 4]
    assert meshes["mesh"].coordinates[5] == (1, 1)
    assert meshes["other"].coordinates == {1: (0,), 0: (1,)}


def test_values_and_plain_dims():
    values = sdy.values(PER_VALUE)
    assert [(v.mesh, v.dims_text) for v in values] == [("mesh", '{"data"}, {}'), ("mesh", '{}, {"model", "data"}')]
    assert values[1].rest == ', replicated={"x"}'
    assert sdy.dims(values[1].dims_text) == [[], ["model", "data"]]
    assert sdy.values('#sdy.sharding<@mesh, [{}, {"data"}]>')[0].dims_text == '{}, {"data"}'


def test_what_is_no_plain_split_of_whole_axes_reads_as_none():
    assert sdy.dims('{"data":(1)2}, {}') is None     # a sub-axis
    assert sdy.dims('{"data", ?}, {}') is None       # an open dimension
    assert sdy.dims('{"data"}p1, {}') is None        # a priority
    assert sdy.dims("{}, {}") == [[], []]


def test_replace_value_keeps_the_mesh_and_the_rest():
    text = sdy.replace_value(PER_VALUE, 1, [["data"], ["model"]])
    assert text == ('#sdy.sharding_per_value<[<@mesh, [{"data"}, {}]>, <@mesh, [{"data"}, {"model"}], '
                    'replicated={"x"}>]>')
    assert sdy.dims_text(sdy.dims('{"a", "b"}, {}')) == '{"a", "b"}, {}'
