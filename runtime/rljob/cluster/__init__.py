"""Ray and the role handles: this attempt's Ray node, placement of every worker, and one
object per role the driver drives (`TrainerGroup`, `EngineGroup`, `RolloutPipeline`,
`WeightSyncActors`). Every call the driver makes on another process's actor is here."""
