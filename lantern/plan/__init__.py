"""`--method auto`: the candidate plans, the model's acceptance records, this machine's latency calibration, and
the choice by predicted wall time (`choose`)."""
