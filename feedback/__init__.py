"""The training-inference feedback loop: serving-side expert load in, ranked suggestions out,
approvals through the run's controls table, outcomes into a knowledge base. Imports only
`meshscope.collector` of ours."""
