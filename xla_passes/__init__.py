"""Compiler passes for XLA's distributed training, written in Python.

The passes (collective combiners, reassociation, reduce-scatter creation and the
like) rewrite modules held in the ``hlo_tools`` IR: parse HLO text with
``hlo_tools.parse_module``, run a pass over the module, and print the result
back to HLO text that XLA accepts.
"""
