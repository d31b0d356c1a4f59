"""Root cause: facts read from a run, hypotheses that each explain some of them, and a ranking
(`meshscope explain`, the view's causes). Imports `meshscope.collector` and
`meshscope.detectors` of ours."""
