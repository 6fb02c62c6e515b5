"""Our combiners against OpenXLA's own combiner tests (../shared/corpus/xla_tests), when present.

Every module of `all_reduce_combiner/`, `all_gather_combiner/` and `reduce_scatter_combiner/`
runs through our pass with the options XLA's test gives its pass, and the table says what
XLA's test expects: how many collectives are left, and what else the test checks (the combined
op's sharding, metadata, frontend attributes, gather dimensions). Where we differ on purpose,
the entry says what we do instead and why; options XLA has and we do not are marked "not
implemented". The modules of `all_reduce_reassociate/` that carry `collective_group_key` run
through `all-reduce-combiner` too (XLA's rule: differently keyed collectives never combine);
the passes of `reduce_scatter_creator/` and `all_reduce_reassociate/` are not ours, and their
entries say so.

XLA's expectations are from the test files the corpus README names (all_reduce_combiner_test.cc
@ 7dcc035, all_gather_combiner_test.cc @ 80c095f, reduce_scatter_combiner_test.cc @ 0cf0dcf).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest

import hlo_tools
import xla_passes
from support import CORPUS_DIR, needs_corpus

pytestmark = needs_corpus

ALL_REDUCE = "all-reduce-combiner{threshold_bytes=1048576}"                 # AllReduceCombiner(1 MiB, 256)
ALL_GATHER = "all-gather-combiner{threshold_bytes=1048576%s}"               # AllGatherCombiner(1 MiB, 256, by_dim)
REDUCE_SCATTER = "reduce-scatter-combiner{threshold_bytes=10485760%s}"      # kMaxByteCount = 10 MiB
NOT_BY_DIM = ",combine_by_dim=false"
SAME_STRUCTURE = ("structurally equal reducers combine here (XLA combines only reducers of one binary op): "
                  "the two convert-add-convert computations compute the same")
NO_WHILE_OPTION = ("not implemented: combine_while_loops=false (XLA's default, true, combines in while bodies, "
                   "as we always do)")


@dataclasses.dataclass(frozen=True)
class Case:
    """One XLA test module: our pipeline with XLA's options, the collectives before and what XLA's
    test expects after; `ours` and `differs` where we do otherwise, and why."""

    passes: str
    before: int
    after: int
    check: Callable[[list[hlo_tools.HloInstruction]], None] | None = None   # XLA's further checks, on the
    ours: int | None = None                                                 # combined (tuple-shaped) ops
    differs: str = ""

    @property
    def expected(self) -> int:
        return self.after if self.ours is None else self.ours


def sharding(text: str):
    def check(combined):
        assert [str(op.attrs.get("sharding")) for op in combined] == [text]
    return check


def metadata(op_type: str, op_name: str):
    def check(combined):
        (op,) = combined
        assert (op.attrs["metadata"].get("op_type"), op.attrs["metadata"].get("op_name")) == (op_type, op_name)
    return check


def dimensions(*dims: int):
    def check(combined):
        assert sorted(op.attrs["dimensions"][0] for op in combined) == sorted(dims)
    return check


def frontend_and_metadata(combined):
    (op,) = combined
    assert dict(op.attrs["frontend_attributes"].items) == {"is_pipelineable": "true", "color": "blue,red"}
    metadata("ag", "model/layer/(ag_0:ag_1)")(combined)


TABLE: dict[str, Case] = {
    # all_reduce_combiner_test.cc
    "all_reduce_combiner/CombineFromTwoDomainsWithSameMetadata": Case(
        ALL_REDUCE, 3, 2, sharding("{{maximal device=0}, {maximal device=0}}")),
    "all_reduce_combiner/CrossCombineGroupCycle": Case(ALL_REDUCE, 6, 4),
    "all_reduce_combiner/CrossCoreAllReduce": Case(ALL_REDUCE, 4, 2),
    "all_reduce_combiner/DoNotCombineCrossShardAndCrossReplicaInSPMD": Case(ALL_REDUCE, 2, 2),
    "all_reduce_combiner/DoNotCombineWithControlDependencies": Case(ALL_REDUCE, 3, 3),
    "all_reduce_combiner/DomainPreventsCombining": Case(ALL_REDUCE, 2, 2),
    "all_reduce_combiner/IndependentBlocksWithDependentStages": Case(ALL_REDUCE, 8, 2),
    "all_reduce_combiner/PreservesMetadata": Case(
        ALL_REDUCE, 2, 1, metadata("test_type0", "(test_name0:test_name1)"),
        differs="XLA's test (7dcc035) expects the first member's op_name, test_name0; we merge op_names as "
                "XLA's all-gather and reduce-scatter combiner tests expect, (test_name0:test_name1)"),
    # all_gather_combiner_test.cc
    "all_gather_combiner/CombineAllGathers": Case(ALL_GATHER % "", 2, 1),
    "all_gather_combiner/CombineAllGathersByAllGatherDimension": Case(ALL_GATHER % "", 5, 2, dimensions(0, 1)),
    "all_gather_combiner/CombineAllGathersByDim": Case(ALL_GATHER % "", 5, 2, dimensions(0, 1)),
    "all_gather_combiner/CombineAllGathersDifferentDims": Case(ALL_GATHER % NOT_BY_DIM, 2, 1, dimensions(0)),
    "all_gather_combiner/CombineDifferentDtypes": Case(
        ALL_GATHER % "", 2, 2, ours=1,
        differs="not implemented: combine_different_dtypes=false (XLA's default, true, combines f32 and s32 "
                "all-gathers, as we always do)"),
    "all_gather_combiner/CombineFromTwoDomainsWithSameMetadata": Case(
        ALL_GATHER % "", 3, 2, sharding("{{maximal device=0}, {maximal device=0}}")),
    "all_gather_combiner/CombineManyAllGathersDifferentDims": Case(ALL_GATHER % NOT_BY_DIM, 5, 1, dimensions(0)),
    "all_gather_combiner/CombineManyAllGathersDifferentDimsMixedRanks": Case(
        ALL_GATHER % NOT_BY_DIM, 5, 1, dimensions(0)),
    "all_gather_combiner/CombineManyAllGathersDifferentDimsRank4": Case(
        ALL_GATHER % NOT_BY_DIM, 5, 1, dimensions(0)),
    "all_gather_combiner/CombineUpToThreshold": Case("all-gather-combiner{threshold_bytes=256}", 2, 1),
    "all_gather_combiner/DoNotCombineInWhileLoop": Case(ALL_GATHER % "", 2, 2, ours=1, differs=NO_WHILE_OPTION),
    "all_gather_combiner/DoNotCombineOverThreshold": Case("all-gather-combiner{threshold_bytes=255}", 2, 2),
    "all_gather_combiner/DomainPreventsCombining": Case(ALL_GATHER % "", 2, 2),
    "all_gather_combiner/NoDependentCombination": Case(ALL_GATHER % "", 2, 2),
    "all_gather_combiner/NoDifferentReplicaGroupsCombination": Case(ALL_GATHER % "", 2, 2),
    "all_gather_combiner/PreservesFrontendAttributesAndMergedMetadata": Case(
        ALL_GATHER % "", 2, 1, frontend_and_metadata),
    "all_gather_combiner/PreservesMetadata": Case(
        ALL_GATHER % "", 2, 1, metadata("test_type0", "(test_name0:test_name1)")),
    # reduce_scatter_combiner_test.cc
    "reduce_scatter_combiner/DependentReduceScatter": Case(REDUCE_SCATTER % "", 2, 2),
    "reduce_scatter_combiner/DifferentDimensions": Case(REDUCE_SCATTER % NOT_BY_DIM, 4, 1, dimensions(0)),
    "reduce_scatter_combiner/DifferentDimensionsAndRanks": Case(REDUCE_SCATTER % NOT_BY_DIM, 3, 1, dimensions(0)),
    "reduce_scatter_combiner/DoNotCombineInWhileLoop": Case(
        "reduce-scatter-combiner{threshold_bytes=1048576,combine_by_dim=false}", 2, 2,
        differs=NO_WHILE_OPTION + "; here both are over the 1 MiB threshold on their own, so neither combines"),
    "reduce_scatter_combiner/DoNotCombineMismatched": Case(REDUCE_SCATTER % "", 2, 2),
    "reduce_scatter_combiner/DoNotCombineWithoutReductionKind": Case(
        REDUCE_SCATTER % "", 2, 2, ours=1, differs=SAME_STRUCTURE),
    "reduce_scatter_combiner/HighThreshold": Case(
        f"reduce-scatter-combiner{{threshold_bytes={67108864 + 67108864 + 50331648 + 16777216}{NOT_BY_DIM}}}", 4, 1,
        dimensions(0)),
    "reduce_scatter_combiner/PreservesMetadata": Case(
        REDUCE_SCATTER % "", 2, 1, metadata("test_type0", "(test_name0:test_name1)")),
    "reduce_scatter_combiner/Simple": Case(REDUCE_SCATTER % "", 2, 1),
    "reduce_scatter_combiner/SimpleMultipleGroups": Case(REDUCE_SCATTER % "", 4, 2, dimensions(0, 1)),
    # XLA's rule for collective_group_key (xla/side_effect_util.h), on all_reduce_reassociate_test.cc's modules
    "all_reduce_reassociate/DoesNotReassociateDifferentCollectiveGroupKeys": Case(ALL_REDUCE, 2, 2),
    "all_reduce_reassociate/DoesNotReassociateKeyedAndUnkeyedCollectives": Case(ALL_REDUCE, 2, 2),
    "all_reduce_reassociate/ReassociatesMatchingCollectiveGroupKeys": Case(ALL_REDUCE, 2, 1),
}

# Passes of the corpus that we do not have: their modules are listed, not run.
NOT_IMPLEMENTED = {
    "reduce_scatter_creator": "not implemented: ReduceScatterCreator (XLA GPU: an all-reduce whose every use is a "
                              "dynamic-slice of the device's own shard becomes a reduce-scatter); weight-update-"
                              "sharding makes reduce-scatters from the update instead",
    "all_reduce_reassociate": "not implemented: AllReduceReassociate (all-reduce(a) + all-reduce(b) -> "
                              "all-reduce(a + b)); the simplifier and the combiners cut all-reduces another way",
}


def collectives(module: hlo_tools.HloModule, opcode: str) -> list[hlo_tools.HloInstruction]:
    return [instr for instr in module.instructions() if instr.opcode == opcode]


def opcode_of(passes: str) -> str:
    return passes.split("{")[0].removesuffix("-combiner")


def corpus_modules(directory: str) -> list[str]:
    return sorted(f"{directory}/{path.stem}" for path in (CORPUS_DIR / directory).glob("*.hlo"))


@pytest.mark.parametrize("name", sorted(TABLE))
def test_xla_combiner_case(name):
    case = TABLE[name]
    module = hlo_tools.parse_module((CORPUS_DIR / f"{name}.hlo").read_text())
    opcode = opcode_of(case.passes)
    assert len(collectives(module, opcode)) == case.before
    xla_passes.run_passes(module, case.passes)
    hlo_tools.verify(module)
    left = collectives(module, opcode)
    assert len(left) == case.expected, case.differs or f"XLA's test expects {case.after}"
    if case.check is not None:
        case.check([op for op in left if op.shape.is_tuple])


@pytest.mark.parametrize("name", [name for directory in NOT_IMPLEMENTED for name in corpus_modules(directory)
                                  if name not in TABLE])
def test_corpus_modules_of_passes_we_lack_are_listed(name):
    pytest.skip(NOT_IMPLEMENTED[name.split("/")[0]])


def test_the_table_covers_every_combiner_module():
    combiner_modules = {name for directory in ("all_reduce_combiner", "all_gather_combiner", "reduce_scatter_combiner")
                        for name in corpus_modules(directory)}
    assert combiner_modules <= set(TABLE)
    assert len(combiner_modules) == 35
    assert all(case.differs for case in TABLE.values() if case.ours is not None)
