"""Hand-written HLO modules that tests in more than one folder use."""

# Two fusions and three all-reduces, in the style of XLA's printer (what the hook parses): the module of
# tests/ir/test_lazy_bodies.py (lazy parsing) and tests/xla/test_proto_patch.py (the hook's proto patch).
FUSIONS_AND_ALL_REDUCES = """HloModule step, entry_computation_layout={(f32[8]{0}, f32[8]{0})->(f32[8]{0}, f32[8]{0})}

%region_0.1 (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x.1, %y.1)
}

%fused_computation (param_0: f32[8], param_1: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  %param_1 = f32[8]{0} parameter(1)
  ROOT %multiply.1 = f32[8]{0} multiply(%param_0, %param_1), metadata={op_name="mul"}
}

%fused_computation.1 (param_0.1: f32[8]) -> f32[8] {
  %param_0.1 = f32[8]{0} parameter(0)
  %constant.1 = f32[] constant(2)
  %broadcast.1 = f32[8]{0} broadcast(%constant.1), dimensions={}
  ROOT %add.2 = f32[8]{0} add(%param_0.1, %broadcast.1)
}

ENTRY %main (p0: f32[8], p1: f32[8]) -> (f32[8], f32[8]) {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %fusion = f32[8]{0} fusion(%p0, %p1), kind=kLoop, calls=%fused_computation
  %all-reduce = f32[8]{0} all-reduce(%fusion), replica_groups={}, to_apply=%region_0.1
  %fusion.1 = f32[8]{0} fusion(%p1), kind=kLoop, calls=%fused_computation.1
  %all-reduce.1 = f32[8]{0} all-reduce(%fusion.1), replica_groups={}, to_apply=%region_0.1
  ROOT %tuple = (f32[8]{0}, f32[8]{0}) tuple(%all-reduce, %all-reduce.1)
}
"""
