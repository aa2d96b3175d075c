"""Training checkpoints: ``ckpt-<step>/`` written atomically (:mod:`.atomic`), read back with
checks (:mod:`.resume`), through ``torch.distributed.checkpoint`` at any world size
(:mod:`.dcp`, its files checked and read safely by :mod:`.safe_reader`), and DiLoCo/FoMoE's
per-rank replicas (:mod:`.replicas`)."""

from hyla.train.checkpointing.atomic import (
    STATE,
    guarded_save,
    publish,
    remove_stale_temps,
    save_train_checkpoint,
)
from hyla.train.checkpointing.resume import (
    RESUME_FIXED,
    check_safetensors,
    is_train_checkpoint,
    load_train_state,
    restore_optimizers,
    restore_weights,
    run_dir_of,
)

__all__ = ["RESUME_FIXED", "STATE", "check_safetensors", "guarded_save", "is_train_checkpoint",
           "load_train_state", "publish", "remove_stale_temps", "restore_optimizers",
           "restore_weights", "run_dir_of", "save_train_checkpoint"]
