"""Middleware: the small steps RL pipelines are made of. Each documents the context fields it reads and writes."""
from conveyor.middleware.advantage import gae_estimator, generalized_advantage
from conveyor.middleware.barrier import Barrier
from conveyor.middleware.ckpt import (CONVERTERS, FORMAT_VERSION, CheckpointError, CheckpointVersionError, CkptSaver,
                                     load_checkpoint, restore, save_checkpoint)
from conveyor.middleware.collector import EPISODE_EVENT, EpisodeCollector, StepCollector, eps_greedy_handler
from conveyor.middleware.collector_process import ProcessCollector, collection_builder
from conveyor.middleware.enhancer import NStepEnhancer, nstep_returns, nstep_reward_enhancer
from conveyor.middleware.exchanger import ContextExchanger, ModelExchanger
from conveyor.middleware.evaluator import (EVAL_EVENT, EVAL_PROGRESS_EVENT, EvaluationError, InteractionEvaluator,
                                          evaluate, interaction_evaluator)
from conveyor.middleware.off_policy import OffPolicyLearner, data_pusher
from conveyor.middleware.logger import offline_logger, online_logger, progress_bar, wandb_online_logger
from conveyor.middleware.offline import EpisodeRecorder, OfflineDataFetcher, episode_recorder, offline_data_fetcher
from conveyor.middleware.termination import termination_checker
from conveyor.middleware.on_policy import MultistepTrainer, Trainer, multistep_trainer, trainer
from conveyor.middleware.actor_learner import UnrollLearner, unroll_cutter, unroll_learner

__all__ = ["Barrier", "EpisodeRecorder", "OfflineDataFetcher", "episode_recorder", "offline_data_fetcher",
           "CONVERTERS", "FORMAT_VERSION", "CheckpointError", "CheckpointVersionError", "CkptSaver", "ContextExchanger", "ModelExchanger", "EPISODE_EVENT", "EVAL_EVENT", "EVAL_PROGRESS_EVENT", "EpisodeCollector", "EvaluationError",
           "InteractionEvaluator", "MultistepTrainer", "NStepEnhancer", "OffPolicyLearner", "ProcessCollector", "StepCollector", "Trainer", "UnrollLearner",
           "collection_builder", "data_pusher", "eps_greedy_handler", "evaluate", "gae_estimator", "generalized_advantage",
           "interaction_evaluator", "load_checkpoint", "multistep_trainer", "nstep_returns", "nstep_reward_enhancer",
           "offline_logger", "online_logger", "progress_bar", "restore", "save_checkpoint", "termination_checker", "trainer",
           "unroll_cutter", "unroll_learner", "wandb_online_logger"]
