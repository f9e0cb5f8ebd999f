"""Hide TensorFlow from a test subprocess that does not use it.

TensorFlow is installed beside the suite (KerasHub's extra pulls it in), and
`keras.utils.set_random_seed` imports it to seed it, as KerasHub's import
does: about 10 CPU-seconds in every torchrun rank and JAX worker process on
this machine, none of which runs TensorFlow. Marked absent in `sys.modules`,
TensorFlow is what Keras and KerasHub see on a machine without it (an
`ImportError` on import), so these processes run as they would there.

Not used by the workers whose tests check how a rank ends
(`torch_exit_worker`, `torch_checkpoint_worker`): a KerasHub user's ranks
import TensorFlow, and its threads are among those alive at interpreter exit.
"""

import sys


def hide() -> None:
    """Make `import tensorflow` raise `ImportError` in this process.

    Call it first in a subprocess's `__main__` block, never in a process
    that may run TensorFlow (pytest's own processes); it does nothing where
    TensorFlow is imported already.
    """
    sys.modules.setdefault("tensorflow", None)
