"""The tools around the passes: `opt` (the `xla-opt` command line), `validation` (translation
validation: run a module before and after the passes on the same inputs and compare) and
`testing` (FileCheck `.hlo` tests and the pytest plugin that collects them).

Importing this package imports none of its modules.
"""
