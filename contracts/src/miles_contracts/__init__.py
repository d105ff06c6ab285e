"""Miles contracts: the small typed data and protocols shared by the kernel and every plugin.

Nothing here imports torch, transformers or an HTTP framework at import time.
"""

from miles_contracts.algorithm import AlgorithmParams
from miles_contracts.batch import AdvantageResult, TrainBatch
from miles_contracts.capture import CapturedPiece, CaptureError, CaptureSpec, EngineCapture, check_tiling
from miles_contracts.cluster import Endpoint, Node, Service, ServiceLaunch
from miles_contracts.moe import MoeLayerMap
from miles_contracts.protocols import (
    AdvantageEstimator,
    AgentFn,
    DataSource,
    EngineClient,
    EngineSpec,
    Executor,
    Filter,
    FilterVerdict,
    ForwardContext,
    GenerateContext,
    Generator,
    ModelBridge,
    RewardFn,
    RouterMiddleware,
    RouterRequest,
    RouterResponse,
    Tool,
    Tracker,
    TrainBackend,
    WeightTransport,
)
from miles_contracts.sample import ExitReason, Sample, SampleError, Stash, StashKey, Status
from miles_contracts.weights import TransferReport, WeightBucket, bucketize

__version__ = "0.1.0"

__all__ = [
    "AdvantageEstimator",
    "AdvantageResult",
    "AgentFn",
    "AlgorithmParams",
    "CaptureError",
    "CaptureSpec",
    "CapturedPiece",
    "DataSource",
    "EngineCapture",
    "EngineClient",
    "EngineSpec",
    "Endpoint",
    "Executor",
    "ExitReason",
    "Filter",
    "FilterVerdict",
    "ForwardContext",
    "GenerateContext",
    "Generator",
    "ModelBridge",
    "MoeLayerMap",
    "Node",
    "RewardFn",
    "RouterMiddleware",
    "RouterRequest",
    "RouterResponse",
    "Sample",
    "SampleError",
    "Service",
    "ServiceLaunch",
    "Stash",
    "StashKey",
    "Status",
    "Tool",
    "Tracker",
    "TrainBackend",
    "TrainBatch",
    "TransferReport",
    "WeightBucket",
    "WeightTransport",
    "bucketize",
    "check_tiling",
]
