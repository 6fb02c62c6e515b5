"""The pass contract (issue 22): `run(module, context)` with a `PassContext`, `PassResult`, composite
passes as registered pipelines, rollback by `HloModule.checkpoint` (no text), and the pipeline text
parsed once on the walk from `XLA_PASSES` to XLA."""
import dataclasses

import pytest

import hlo_tools
import xla_passes
import xla_passes.jax
from hlo_tools.ir.hlo import HloModule
from xla_passes import HloPass, PassContext, PassError, PassPipeline, PassResult, Pipeline
from xla_passes import core, pipeline as pipeline_module
from xla_passes.frontends import configuration
from xla_passes.analysis import collectives

MODULE = """HloModule step, replica_count=2

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

fused {
  p = f32[4] parameter(0)
  ROOT n = f32[4] negate(p)
}

ENTRY main {
  a = f32[4] parameter(0)
  b = f32[8] parameter(1)
  f = f32[4] fusion(a), kind=kLoop, calls=fused
  ra = f32[4] all-reduce(f), replica_groups={{0,1}}, to_apply=add
  rb = f32[8] all-reduce(b), replica_groups={{0,1}}, to_apply=add
  ga = f32[8] all-gather(a), replica_groups={{0,1}}, dimensions={0}
  gb = f32[8] all-gather(ra), replica_groups={{0,1}}, dimensions={0}
  ROOT t = (f32[4], f32[8], f32[8], f32[8]) tuple(ra, rb, ga, gb)
}
"""


@pytest.fixture
def copies(monkeypatch):
    """Counts of what the walk costs: module texts printed, modules parsed, pipeline texts parsed."""
    counts = {"to_text": 0, "parse_module": 0, "parse_pipeline": 0}
    to_text, parse_module = HloModule.to_text, hlo_tools.parse_module
    parser_init = pipeline_module._PipelineParser.__init__

    def counting_to_text(self, *args, **kwargs):
        counts["to_text"] += 1
        return to_text(self, *args, **kwargs)

    def counting_parse(*args, **kwargs):
        counts["parse_module"] += 1
        return parse_module(*args, **kwargs)

    def counting_parser(self, text, composites=()):
        counts["parse_pipeline"] += not composites   # the user's text, not a composite's own
        parser_init(self, text, composites)

    monkeypatch.setattr(HloModule, "to_text", counting_to_text)
    monkeypatch.setattr(hlo_tools, "parse_module", counting_parse)
    monkeypatch.setattr(pipeline_module._PipelineParser, "__init__", counting_parser)
    return counts


# -- rollback: a checkpoint of the objects, no text -----------------------------------------------------

class _Wreck(HloPass):
    """Edits everything it can, then fails."""

    name = "test-wreck"

    def run(self, module, context=None):
        entry = module.entry
        fused = module.computation("fused")
        fused.root.set_shape(hlo_tools.parse_shape("f32[5]"))   # parses the lazy body, and edits it
        neg = entry.add_instruction("negate", [entry.get("b")], entry.get("b").shape)
        entry.get("rb").replace_all_uses_with(neg)
        entry.remove_instruction(entry.get("rb"))
        module.set_attr("replica_count", 4)
        raise RuntimeError("wrecked")


def test_a_failed_pass_is_rolled_back_without_printing_or_parsing(copies):
    module = hlo_tools.parse_module(MODULE, lazy_bodies=True)
    copies["parse_module"] = 0
    entry, rb, fused = module.entry, module.entry.get("rb"), module.computation("fused")
    assert not fused.parsed
    with pytest.raises(PassError, match="pass test-wreck: RuntimeError: wrecked"):
        Pipeline([_Wreck()]).run(module)
    assert copies == {"to_text": 0, "parse_module": 0, "parse_pipeline": 0}
    assert module.entry is entry and entry.get("rb") is rb and rb.users == [entry.root]   # the same objects
    assert not fused.parsed   # back to its source text, still lazy
    assert not module.header_edited and not module.computations_edited and not entry.edited
    assert HloModule.to_text(module) == MODULE   # byte for byte, as parsed
    assert Pipeline("collective-fusion").run(module)   # and it goes on being edited normally
    hlo_tools.verify(module)


def test_a_checkpoint_restores_any_number_of_times():
    module = hlo_tools.parse_module(MODULE)
    saved = module.checkpoint()
    for _ in range(2):
        assert xla_passes.run_passes(module, "all-reduce-combiner,dce")
        assert module.to_text() != MODULE
        saved.restore()
        assert module.to_text() == MODULE
        hlo_tools.verify(module)


def test_replace_contents_is_the_public_way_to_swap_a_module():
    module = hlo_tools.parse_module(MODULE)
    other = hlo_tools.parse_module(MODULE.replace("replica_count=2", "replica_count=2, num_partitions=1"))
    module.replace_contents(other)
    assert module.num_partitions == 1 and all(c.parent is module for c in module.computations)


# -- the context, the result --------------------------------------------------------------------------

def test_passes_get_the_context_and_old_style_passes_still_run():
    seen = []

    class New(HloPass):
        name = "test-new"

        def run(self, module, context=None):
            seen.append(context)
            return PassResult(False, ("unchanged: nothing to do here",))

    class Old(HloPass):
        name = "test-old"

        def run(self, module):
            seen.append("old")
            return False

    module = hlo_tools.parse_module(MODULE)
    pipeline = Pipeline([New(), Old()], platform="cuda", layouts_final=True)
    assert not pipeline.run(module)
    context, old = seen
    assert old == "old" and isinstance(context, PassContext)
    assert (context.platform, context.layouts_final, context.combiner_thresholds) == ("cuda", True, (30 << 20, 256))
    assert pipeline.reports() == ["unchanged: nothing to do here"]   # findings are the pass's report
    assert bool(PassResult(True)) and not PassResult(False)


def test_the_combiners_share_one_scope_through_the_context(monkeypatch):
    calls = []
    scope = collectives.combiner_scope
    monkeypatch.setattr(collectives, "combiner_scope", lambda module: calls.append(module) or scope(module))
    module = hlo_tools.parse_module(MODULE)
    assert Pipeline("collective-fusion{simplify=false}").run(module)
    assert len(calls) == 1   # three combiners, one walk (each keeps it valid: `preserves`)
    calls.clear()
    class Changes(HloPass):
        name = "test-changes"

        def run(self, module, context=None):
            return True   # keeps no analysis (`preserves` is empty)

    combiners = xla_passes.parse_pipeline("all-gather-combiner,all-reduce-combiner")
    assert Pipeline([combiners[0], Changes(), combiners[1]]).run(hlo_tools.parse_module(MODULE))
    assert len(calls) == 2   # the pass between them changed the module and keeps nothing: computed again


# -- composite passes are registered pipelines ----------------------------------------------------------

def test_collective_fusion_is_a_registered_pipeline_run_as_one_step(tmp_path):
    (fusion,) = xla_passes.parse_pipeline("collective-fusion{threshold_count=8,combine_by_dim=false}")
    assert isinstance(fusion, PassPipeline)
    assert fusion.pipeline_text() == ("all-reduce-simplifier,all-gather-combiner{threshold_count=8,combine_by_dim=false},"
                                      "all-reduce-combiner{threshold_count=8},"
                                      "reduce-scatter-combiner{threshold_count=8,combine_by_dim=false}")
    assert [p.name for p in fusion.passes] == ["all-reduce-simplifier", "all-gather-combiner",
                                               "all-reduce-combiner", "reduce-scatter-combiner"]
    assert fusion.opcodes == {"all-reduce": 1, "all-gather": 2, "reduce-scatter": 2}
    module = hlo_tools.parse_module(MODULE)
    pipeline = Pipeline("collective-fusion", dump_to=str(tmp_path))
    assert pipeline.run(module)
    assert [run.name for run in pipeline.log] == ["collective-fusion"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["module_0000.step.0001.after_collective-fusion.txt",
                                                          "module_0000.step.before_xla_passes.txt"]
    again = hlo_tools.parse_module(MODULE)
    assert xla_passes.pass_class("collective-fusion")().run(again)   # on its own, as before
    assert again.to_text() == module.to_text()


def test_a_users_composite_registers_and_may_not_name_itself(monkeypatch):
    monkeypatch.setattr(core, "_REGISTRY", dict(core._REGISTRY))   # the test's passes go with the test
    @xla_passes.register_pass
    class Tidy(PassPipeline):
        """cse then dce."""

        name = "test-tidy"
        keep_dead: bool = False

        def pipeline_text(self):
            return "cse" if self.keep_dead else "cse,dce"

    assert [p.name for p in xla_passes.parse_pipeline("test-tidy")[0].passes] == ["cse", "dce"]
    assert [p.name for p in xla_passes.parse_pipeline("test-tidy{keep_dead=true}")[0].passes] == ["cse"]
    with pytest.raises(PassError, match="unknown option 'x'"):
        xla_passes.parse_pipeline("test-tidy{x=1}")

    @xla_passes.register_pass
    class Loop(PassPipeline):
        """Names itself."""

        name = "test-loop"

        def pipeline_text(self):
            return "dce,test-loop"

    with pytest.raises(PassError, match="composite pass test-loop names itself"):
        xla_passes.parse_pipeline("test-loop")


# -- Settings holds the parsed pipeline: one parse, fresh passes for each module -------------------------

def test_settings_parse_once_and_each_run_clones_the_passes(copies):
    settings = configuration.settings_from_environment({"XLA_PASSES": "collective-fusion{threshold_count=8},dce"})
    assert copies["parse_pipeline"] == 1
    one, two = settings.pipeline.clone(), settings.pipeline.clone(platform="cpu")
    assert copies["parse_pipeline"] == 1
    assert str(one) == str(two) == str(settings.pipeline) == "collective-fusion{threshold_count=8},dce"
    assert one.passes[0] is not two.passes[0] and one.passes[0].passes[0] is not two.passes[0].passes[0]
    assert (one.platform, two.platform, settings.pipeline.platform) == (None, "cpu", None)
    with pytest.raises(TypeError, match="unexpected option 'colour'"):
        settings.pipeline.clone(colour="red")
    assert dataclasses.replace(settings, strict=True) == configuration.Settings(settings.passes, strict=True)


def test_one_hooked_compile_parses_the_pipeline_once_and_prints_the_module_at_most_once(copies):
    """The walk from `XLA_PASSES` to XLA: the text parsed once (in the settings), the module parsed
    once, and printed at most once for XLA (rollback checkpoints print nothing)."""
    from hlo_tools.xla import xla_bridge

    proto = xla_bridge.text_to_proto(MODULE)
    copies.update(to_text=0, parse_module=0)
    settings = configuration.settings_from_environment(
        {"XLA_PASSES": "collective-fusion,cse,dce", "XLA_PASSES_STRICT": "1"})
    xla_passes.jax.check_hook_passes(settings)
    rewritten = xla_passes.jax.rewrite_module(proto, settings, "cpu")
    assert rewritten is not None
    assert copies["parse_pipeline"] == 1 and copies["parse_module"] == 1
    assert copies["to_text"] <= 1
    text = xla_bridge.proto_to_text(rewritten)
    assert text.count("all-reduce(") == 1 and text.count("all-gather(") == 1


def test_a_real_jax_compile_through_the_hook(copies):
    import jax
    import jax.numpy as jnp

    settings = configuration.settings_from_environment({"XLA_PASSES": "collective-fusion", "XLA_PASSES_STRICT": "1"})
    step = jax.pmap(lambda a, b: (jax.lax.psum(a, "i"), jax.lax.psum(b, "i")), axis_name="i",
                    devices=jax.devices()[:2])
    xla_passes.jax.apply(settings)
    try:
        copies.update(to_text=0, parse_module=0)
        compiled = step.lower(jnp.ones((2, 4)), jnp.ones((2, 8))).compile()
    finally:
        xla_passes.jax.apply(None)
    assert copies["parse_pipeline"] == 1 and copies["parse_module"] == 1 and copies["to_text"] <= 1
    assert compiled.as_text().count("all-reduce(") + compiled.as_text().count("all-reduce-start(") == 1
