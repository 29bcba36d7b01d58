"""route: a layer of the data path (it runs in planning, before clustering). Choose the tier that generates each
item, and say why (`route_reason`).

  rules.py     configured rules first (the first match decides), then the router, then the default tier
  router.py    the learned router: cheap text features, logistic regression, calibrated on labels

Layer: may import pipeline.dedup, pipeline.ingest, pipeline.stores and the base; never
pipeline.generate or a later layer. tests/unit/test_architecture.py enforces this.
"""
