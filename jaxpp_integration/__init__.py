"""jaxpp_integration: an MPMD pipeline-parallel engine for JAX in the style of NVIDIA's JaxPP.

`import jaxpp_integration as jaxpp` gives the whole public API (see `api.py`).
"""

from jaxpp_integration import api  # noqa: F401  (jaxpp_integration.api must resolve)
from jaxpp_integration.api import *  # noqa: F403
from jaxpp_integration.api import __all__  # noqa: F401
