from keras_autoshard import simulate_devices; simulate_devices(8)
import keras
from keras_autoshard import *
from tests import models
from tests.test_parity_handwritten import mlp_plan
plan = mlp_plan()
d = PlanDistribution(plan)
x, y = models.mlp_batch()
with d.scope():
    m = models.build_mlp_block(); m.compile(optimizer="adam", loss="mse")
    r = inspect_compiled(m, d, (x, y))
print(r.table())
for s in (r.train_step, r.forward_step):
    for op in s.collectives: print(s.name, op.kind, op.mesh_axes, op.operand_shapes, op.operand_bytes)
print(r.parameter_bytes_per_device, r.optimizer_bytes_per_device, plan.bytes_per_device())
