"""A rank's life in a job: start-up, its role, a restart on a changed world, a drift switch, idling.

- ``job``: join the job, find the role, create the process groups in one order, build the stage.
- ``roles``: which device (and so which stage) each rank drives.
- ``restart``: a job restarted on a changed world re-plans (``hetrain.elastic`` decides).
- ``drift_watch``: every device's compute time watched for drift; a switch of plans (``hetrain.drift`` decides).
- ``idle``: ranks the plan leaves unused join checkpoint writes only.
- ``host_memory``: glibc's malloc kept from returning freed host memory between steps.
"""
