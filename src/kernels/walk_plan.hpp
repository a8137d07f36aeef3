// How a sampler launch walks (logits_pass.cuh's walk mode): a pure function of the launch's shape, the
// device's SM count and the settings, so that the rule is tested on the host (test_sample_cpu) as well as
// through sample_uses_walk() on a GPU. sample.cu's walk_plan() fills in the device and the settings.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/launch_checks.hpp"

namespace smcgraph::detail {

/// How a launch of `jobs` jobs of `splits` tiles walks: one CTA a job (the register walk) or `walkers` CTAs
/// a job (the staged walk), each walking `tiles` consecutive tiles (the last walker's may be fewer; none is
/// empty).
struct WalkPlan {
  bool walk = false;
  int walkers = 1, tiles = 0;
  bool staged() const { return walk && walkers > 1; }
};

/// What the rule reads besides the launch's shape.
struct WalkPlanContext {
  int64_t sms = 0;             ///< the device's multiprocessors
  int register_blocks = 0;     ///< the register walk's CTAs an SM (kPassMinBlocksWalk)
  int staged_blocks = 0;       ///< the staged walk's CTAs an SM (kPassMinBlocksStaged)
  int max_subtiles = 0;        ///< sub-tiles a walked job may have (kMaxWalkSubTiles)
  int subtiles_per_tile = 0;   ///< kSubTiles
  double min_wave_fill = 0.95; ///< kWalkMinWaveFill
  int short_walk_tiles = 0;    ///< kShortWalkTiles: a staged walk of at most this many tiles a walker
                               ///< needs only one walker an SM (0: no short walks)
  int min_jobs_setting = 0;    ///< set_sample_walk_min_jobs(): 0 the default rule, n walk from n jobs
  int max_walkers_setting = 0; ///< set_sample_walk_max_walkers(): 0 the default rule, n at most n walkers
};

/// The default rule (settings 0):
/// - the register walk where its CTAs (one a job) fill at least min_wave_fill of the waves they take;
/// - else the staged walk, with as many walkers a job as one wave of its CTAs holds for the launch's jobs
///   (each walking at least two tiles), where they fill at least min_wave_fill of the waves they take, or,
///   a short walk (at most short_walk_tiles tiles a walker), where they are at least one an SM;
/// - else no walk.
/// A forced walk (min_jobs_setting > 0) walks every launch of at least that many jobs, with the staged
/// walk's walkers (capped by max_walkers_setting), the register walk at one. No walk below two tiles a job
/// or above max_subtiles sub-tiles.
inline WalkPlan plan_walk(int64_t jobs, int splits, const WalkPlanContext& c) {
  WalkPlan plan;
  if (jobs < 1 || splits < 2 || int64_t{splits} * c.subtiles_per_tile > c.max_subtiles)
    return plan;
  const auto fills = [&](int64_t ctas, int64_t slots) {
    return static_cast<double>(ctas) >= c.min_wave_fill * static_cast<double>(ceil_div(ctas, slots) * slots);
  };
  const int64_t staged_slots = c.sms * c.staged_blocks;
  int64_t walkers = std::clamp<int64_t>(staged_slots / jobs, 1, std::max(1, splits / 2));
  if (c.max_walkers_setting > 0)
    walkers = std::min<int64_t>(walkers, c.max_walkers_setting);
  plan.tiles = static_cast<int>(ceil_div(splits, walkers));
  plan.walkers = static_cast<int>(ceil_div(splits, plan.tiles));
  if (c.min_jobs_setting > 0) {
    plan.walk = jobs >= c.min_jobs_setting;
  } else if (fills(jobs, c.sms * c.register_blocks)) {
    plan.walk = true;
    plan.walkers = 1;
  } else {
    const int64_t ctas = jobs * plan.walkers;
    const bool short_walk = plan.tiles <= c.short_walk_tiles && ctas >= c.sms;
    plan.walk = plan.walkers > 1 && (fills(ctas, staged_slots) || short_walk);
  }
  if (plan.walkers == 1)
    plan.tiles = splits;
  return plan;
}

} // namespace smcgraph::detail
