"""The contract, rewardmesh.v1: the generated messages and service stubs of protos/rewardmesh/v1/*.proto."""

from rewardmesh._links import only_as

only_as(__name__, "rewardmesh.v1")
