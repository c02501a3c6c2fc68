"""`instgenie loadtest`: open-loop traffic (Poisson or a replayed trace) against a running
`instgenie serve` over its REST API, with latency percentiles and SLO attainment per rate.

workload.py (what is sent: arrivals, mask ratios, masks, template images), driver.py (sends it
on schedule and records every answer), report.py (statistics), command.py (the CLI).
Light imports only (numpy, PIL, stdlib HTTP): no torch.
"""
