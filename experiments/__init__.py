"""The experiment manager: study recipes -> plan -> Ray launch -> provenance -> collect ->
aggregate and decide -> report. Each step reads what the step before wrote to disk."""
