"""Inspection: statistics, diffs, graphs, reports and the cost model, on top of the IR."""
