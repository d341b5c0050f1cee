"""The package is assembled from links to the repository's folders (`rewardmesh/common` -> `../common`, ...,
`rewardmesh/v1` -> `../protos/rewardmesh/v1`). With the repository's root on sys.path (pytest's rootdir, a
`python` started there) those folders are importable under a second name too (`common`, `server`,
`protos.rewardmesh.v1`), and importing one would load a second copy of every module beside the rewardmesh one:
its own registries, its own classes that `isinstance` tells apart from the real ones. Each linked folder's
`__init__.py` refuses that with `only_as`."""

from __future__ import annotations


def only_as(name: str, home: str) -> None:
    """ImportError unless the package being imported, `name`, is loaded as `home`, its one name."""
    if name != home:
        raise ImportError(
            f"{name!r} is the folder of {home!r} imported under a second name (the repository's root is on "
            f"sys.path), which would load a second copy of its modules: import {home} (and {home}.<module>) instead"
        )
