// The reference runs layer by layer over all live tokens of a forward (the device's order of effects: a
// layer's K and V of every token are stored before any token of that layer attends), one token at a time
// inside a layer, in double precision with the contract's rounding points applied explicitly.
#include "reference/llama_ref.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "smcgraph/error.hpp"

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace smcgraph::reference {

namespace {

double bf16_value(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

/// Sum of f(i) over i in [0, n) in index order: in fp32 (kContractFloat) or in double.
template <class F> double sum_over(int n, bool in_float, F f) {
  if (in_float) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
      const auto [a, b] = f(i);
      sum = std::fma(static_cast<float>(a), static_cast<float>(b), sum);
    }
    return sum;
  }
  double sum = 0.0;
  for (int i = 0; i < n; ++i) {
    const auto [a, b] = f(i);
    sum += a * b;
  }
  return sum;
}

} // namespace

float round_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value))
    bits |= 0x00400000u; // quiet NaN, sign kept
  else
    bits += 0x7fffu + ((bits >> 16) & 1u); // round to nearest, ties to even (overflows to infinity)
  bits &= 0xffff0000u;
  float rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}

LlamaReference::LlamaReference(const LlamaHostWeights& weights, std::vector<int> layers, int pool_size,
                               int max_seq_len, LlamaNumerics numerics)
    : weights_(weights), layers_(std::move(layers)), pool_size_(pool_size), max_seq_len_(max_seq_len),
      numerics_(numerics) {
  const LlamaConfig& c = weights.config;
  if (layers_.empty())
    layers_ = llama_layer_range(0, c.layers);
  for (size_t i = 0; i < layers_.size(); ++i) {
    require(layers_[i] >= 0 && layers_[i] < c.layers && (i == 0 || layers_[i] > layers_[i - 1]),
            "LlamaReference", "layers[i]", layers_[i], "must be strictly increasing layer indices");
  }
  require(pool_size >= 1 && max_seq_len >= 1, "LlamaReference", "pool_size", pool_size,
          "and max_seq_len must be >= 1");
  kv_.assign(layers_.size() * pool_size * 2 * c.kv_heads * c.head_dim, 0.0);
  kv_flip_.assign(kv_.size(), 0.0);
}

double LlamaReference::to_float(double value) const {
  return numerics_ == LlamaNumerics::kExact ? value : static_cast<float>(value);
}

double LlamaReference::to_bf16(double value) const {
  return numerics_ == LlamaNumerics::kExact ? value : round_bf16(static_cast<float>(value));
}

double LlamaReference::dot(const uint16_t* w, const double* x, int n) const {
  return sum_over(n, numerics_ == LlamaNumerics::kContractFloat,
                  [&](int i) { return std::pair<double, double>(bf16_value(w[i]), x[i]); });
}

void LlamaReference::rms_norm(const double* x, const float* weight, double* out) const {
  const int H = config().hidden;
  const double sum_squares =
      sum_over(H, numerics_ == LlamaNumerics::kContractFloat, [&](int i) { return std::pair(x[i], x[i]); });
  const double scale = 1.0 / std::sqrt(to_float(sum_squares / H) + static_cast<double>(config().rms_eps));
  for (int i = 0; i < H; ++i)
    out[i] = to_bf16(x[i] * scale * weight[i]);
}

void LlamaReference::rope(double* v, int position) const {
  const int hd = config().head_dim;
  for (int i = 0; i < hd / 2; ++i) {
    const double exponent = -2.0 * i / hd;
    double angle;
    if (numerics_ == LlamaNumerics::kExact) {
      angle = position * std::pow(static_cast<double>(config().rope_base), exponent);
    } else {
      const float inv_freq = static_cast<float>(std::pow(static_cast<double>(config().rope_base), exponent));
      angle = static_cast<float>(position) * inv_freq; // the contract's fp32 product
    }
    const double c = std::cos(angle), s = std::sin(angle), a = v[2 * i], b = v[2 * i + 1];
    v[2 * i] = a * c - b * s;
    v[2 * i + 1] = a * s + b * c;
  }
}

void LlamaReference::forward(const LlamaForwardInputs& in, std::vector<double>& logits) {
  const LlamaConfig& c = config();
  const int H = c.hidden, F = c.ffn, hd = c.head_dim, qd = c.heads * hd, kvd = c.kv_heads * hd;
  const int group = c.heads / c.kv_heads, per_row = in.tokens_per_row;
  const bool in_float = numerics_ == LlamaNumerics::kContractFloat;
  const size_t V = static_cast<size_t>(c.vocab);
  constexpr const char* kWhere = "LlamaReference::forward";
  require(logits.size() == static_cast<size_t>(in.rows) * per_row * V, kWhere, "logits.size()", logits.size(),
          "must be rows * tokens_per_row * vocab");
  require(in.slot_table.size() == static_cast<size_t>(in.rows) * max_seq_len_, kWhere, "slot_table.size()",
          in.slot_table.size(), "must be rows * max_seq_len");

  struct Token {
    int row, index, position, slot;
    std::vector<double> x, q;
  };
  std::vector<Token> tokens;
  for (int row = 0; row < in.rows; ++row) {
    for (int j = 0; in.live[row] && j < per_row; ++j) {
      const int index = row * per_row + j;
      Token t{row, index, in.positions[index], in.out_slots[index], std::vector<double>(H), {}};
      const int id = std::clamp(in.tokens[index], 0, c.vocab - 1);
      for (int h = 0; h < H; ++h)
        t.x[h] = bf16_value(weights_.token_embd[static_cast<size_t>(id) * H + h]);
      tokens.push_back(std::move(t));
    }
  }
  auto kv_offset = [&](size_t layer, int slot, int kind, int kv_head) {
    return ((layer * pool_size_ + slot) * 2 + kind) * kvd + static_cast<size_t>(kv_head) * hd;
  };
  auto kv_at = [&](size_t layer, int slot, int kind, int kv_head) {
    return kv_.data() + kv_offset(layer, slot, kind, kv_head);
  };
  // The sum of the two largest ulp(n_i) |w_i|: what two inputs rounding the other way change in w . n.
  auto flip_of = [&](const uint16_t* w, const double* n_row) {
    double first = 0.0, second = 0.0;
    for (int i = 0; i < H; ++i) {
      int exponent = 0;
      std::frexp(n_row[i], &exponent);
      const double change =
          n_row[i] == 0.0 ? 0.0 : std::ldexp(1.0, exponent - 8) * std::abs(bf16_value(w[i]));
      if (change > first) {
        second = first;
        first = change;
      } else if (change > second) {
        second = change;
      }
    }
    return first + second;
  };
  std::vector<double> n(H), k(kvd), v(kvd), k_flip(kvd), v_flip(kvd), o(qd), act(F), scores;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const LlamaHostWeights::Layer& L = weights_.layers[layers_[li]];
    // q, k, v of every token; K and V stored before any attention.
    for (Token& t : tokens) {
      rms_norm(t.x.data(), L.attn_norm.data(), n.data());
      t.q.resize(qd);
      for (int r = 0; r < qd; ++r)
        t.q[r] = to_float(dot(L.q.data() + static_cast<size_t>(r) * H, n.data(), H));
      for (int r = 0; r < kvd; ++r) {
        k[r] = to_float(dot(L.k.data() + static_cast<size_t>(r) * H, n.data(), H));
        v[r] = to_bf16(to_float(dot(L.v.data() + static_cast<size_t>(r) * H, n.data(), H)));
        k_flip[r] = flip_of(L.k.data() + static_cast<size_t>(r) * H, n.data());
        v_flip[r] = flip_of(L.v.data() + static_cast<size_t>(r) * H, n.data());
      }
      for (int h = 0; h < c.heads; ++h)
        rope(t.q.data() + h * hd, t.position);
      for (int h = 0; h < c.kv_heads; ++h)
        rope(k.data() + h * hd, t.position);
      for (double& x : t.q)
        x = to_bf16(x);
      if (t.slot < 0 || t.slot >= pool_size_)
        continue;
      for (int h = 0; h < c.kv_heads; ++h) {
        for (int d = 0; d < hd; ++d) {
          kv_at(li, t.slot, 0, h)[d] = to_bf16(k[h * hd + d]);
          kv_at(li, t.slot, 1, h)[d] = v[h * hd + d];
          // RoPE mixes the pair (2i, 2i + 1) with weights of magnitude <= 1.
          const int pair = h * hd + (d & ~1);
          kv_flip_[kv_offset(li, t.slot, 0, h) + d] = k_flip[pair] + k_flip[pair + 1];
          kv_flip_[kv_offset(li, t.slot, 1, h) + d] = v_flip[h * hd + d];
        }
      }
    }
    for (Token& t : tokens) {
      // Attention over positions 0 .. last through the row's slot table.
      const int32_t* table = in.slot_table.data() + static_cast<size_t>(t.row) * max_seq_len_;
      const int last = std::min({t.position, in.seq_lens[t.row] - 1, max_seq_len_ - 1});
      const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
      std::fill(o.begin(), o.end(), 0.0);
      for (int h = 0; h < c.heads && last >= 0; ++h) {
        const double* qh = t.q.data() + h * hd;
        auto slot_of = [&](int position) {
          const int slot = table[position];
          return slot < 0 || slot >= pool_size_ ? 0 : slot;
        };
        scores.assign(last + 1, 0.0);
        for (int p = 0; p <= last; ++p) {
          const double* key = kv_at(li, slot_of(p), 0, h / group);
          scores[p] =
              to_float(sum_over(hd, in_float, [&](int d) { return std::pair(qh[d], key[d]); }) * scale);
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        for (double& s : scores)
          s = to_float(std::exp(s - top));
        const double total = sum_over(last + 1, in_float, [&](int p) { return std::pair(scores[p], 1.0); });
        for (int d = 0; d < hd; ++d) {
          const double weighted = sum_over(last + 1, in_float, [&](int p) {
            return std::pair(scores[p], kv_at(li, slot_of(p), 1, h / group)[d]);
          });
          o[h * hd + d] = to_bf16(weighted / total);
        }
      }
      for (int r = 0; r < H; ++r)
        t.x[r] = to_float(t.x[r] + to_float(dot(L.o.data() + static_cast<size_t>(r) * qd, o.data(), qd)));
      // SwiGLU feed-forward.
      rms_norm(t.x.data(), L.ffn_norm.data(), n.data());
      for (int f = 0; f < F; ++f) {
        const double g = to_float(dot(L.gate.data() + static_cast<size_t>(f) * H, n.data(), H));
        const double u = to_float(dot(L.up.data() + static_cast<size_t>(f) * H, n.data(), H));
        act[f] = to_bf16(g / (1.0 + std::exp(-g)) * u);
      }
      for (int r = 0; r < H; ++r)
        t.x[r] = to_float(t.x[r] + to_float(dot(L.down.data() + static_cast<size_t>(r) * F, act.data(), F)));
    }
  }
  const std::vector<uint16_t>& head = c.tied_head ? weights_.token_embd : weights_.output;
  for (const Token& t : tokens) {
    rms_norm(t.x.data(), weights_.output_norm.data(), n.data());
    double* out = logits.data() + static_cast<size_t>(t.index) * V;
    for (size_t w = 0; w < V; ++w)
      out[w] = to_float(dot(head.data() + w * H, n.data(), H));
  }
}

LlamaForwardInputs LlamaSequences::next(int tokens_per_row, std::mt19937_64& engine) const {
  auto integer = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(engine);
  };
  auto garbage = [&] { return static_cast<int32_t>(integer(INT32_MIN, INT32_MAX)); };
  LlamaForwardInputs in;
  in.rows = static_cast<int>(tokens.size());
  in.tokens_per_row = tokens_per_row;
  const size_t count = static_cast<size_t>(in.rows) * tokens_per_row;
  in.tokens.resize(count);
  in.positions.resize(count);
  in.out_slots.resize(count);
  in.slot_table.resize(static_cast<size_t>(in.rows) * max_seq_len);
  in.seq_lens.resize(in.rows);
  in.live = live;
  for (int row = 0; row < in.rows; ++row) {
    int32_t* table = in.slot_table.data() + static_cast<size_t>(row) * max_seq_len;
    const size_t base = static_cast<size_t>(row) * tokens_per_row;
    if (!live[row]) {
      for (int q = 0; q < max_seq_len; ++q)
        table[q] = garbage();
      for (int j = 0; j < tokens_per_row; ++j) {
        in.tokens[base + j] = garbage();
        in.positions[base + j] = garbage();
        in.out_slots[base + j] = static_cast<int32_t>(integer(1, pool_size - 1));
      }
      in.seq_lens[row] = garbage();
      continue;
    }
    const int first = done[row], end = first + tokens_per_row;
    require(end <= static_cast<int>(tokens[row].size()) && end <= max_seq_len, "LlamaSequences::next",
            "tokens_per_row", tokens_per_row, "runs past the row's sequence");
    for (int q = 0; q < max_seq_len; ++q)
      table[q] = q < end ? slots[row][q] : static_cast<int32_t>(integer(-3, pool_size + 3));
    for (int j = 0; j < tokens_per_row; ++j) {
      in.tokens[base + j] = tokens[row][first + j];
      in.positions[base + j] = first + j;
      in.out_slots[base + j] = slots[row][first + j];
    }
    in.seq_lens[row] = end;
  }
  return in;
}

void LlamaSequences::advance(int tokens_per_row) {
  for (size_t row = 0; row < done.size(); ++row)
    done[row] += live[row] ? tokens_per_row : 0;
}

LlamaSequences random_llama_sequences(const std::vector<int>& lengths, int vocab, int pool_size,
                                      int max_seq_len, double live_fraction, std::mt19937_64& engine) {
  LlamaSequences s;
  s.vocab = vocab;
  s.pool_size = pool_size;
  s.max_seq_len = max_seq_len;
  std::vector<int32_t> free_slots(pool_size - 1);
  for (int i = 0; i < pool_size - 1; ++i)
    free_slots[i] = i + 1;
  std::shuffle(free_slots.begin(), free_slots.end(), engine);
  size_t next_free = 0;
  for (size_t row = 0; row < lengths.size(); ++row) {
    const bool live = row == 0 || std::uniform_real_distribution<double>(0.0, 1.0)(engine) < live_fraction;
    s.live.push_back(live ? 1 : 0);
    s.done.push_back(0);
    s.tokens.emplace_back();
    s.slots.emplace_back();
    for (int p = 0; live && p < lengths[row]; ++p) {
      require(next_free < free_slots.size() && lengths[row] <= max_seq_len, "random_llama_sequences",
              "lengths[row]", lengths[row], "needs more slots than the pool (or positions than max_seq_len)");
      s.tokens.back().push_back(
          static_cast<int32_t>(std::uniform_int_distribution<int>(0, vocab - 1)(engine)));
      s.slots.back().push_back(free_slots[next_free++]);
    }
  }
  return s;
}

std::string LogitsAgreement::summary() const {
  char text[256];
  std::snprintf(text, sizeof(text),
                "%zu logits: max scaled error %.3g, rms error %.3g, rms bf16 noise of the contract %.3g, "
                "near ties %d, top mismatches %d",
                compared, max_error, rms_error, rms_noise, near_ties, top_mismatches);
  return text;
}

LogitsAgreement compare_logits(const LlamaForwardInputs& in, int vocab, const std::vector<double>& got,
                               const std::vector<double>& want, const std::vector<double>* exact,
                               double tolerance) {
  LogitsAgreement a;
  double error_squares = 0.0, noise_squares = 0.0;
  char text[256];
  for (int row = 0; row < in.rows; ++row) {
    for (int j = 0; in.live[row] && j < in.tokens_per_row; ++j) {
      const size_t base = (static_cast<size_t>(row) * in.tokens_per_row + j) * vocab;
      size_t top_got = base, top_want = base;
      for (size_t i = base; i < base + vocab; ++i) {
        const double error = std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i]));
        error_squares += (got[i] - want[i]) * (got[i] - want[i]);
        if (exact != nullptr)
          noise_squares += (want[i] - (*exact)[i]) * (want[i] - (*exact)[i]);
        a.max_error = std::max(a.max_error, std::isnan(error) ? INFINITY : error);
        if (!(error <= tolerance) && a.problem.empty()) {
          std::snprintf(text, sizeof(text),
                        "row %d token %d logit %zu: got %.9g, want %.9g (scaled error %.3g)", row, j,
                        i - base, got[i], want[i], error);
          a.problem = text;
        }
        top_got = got[i] > got[top_got] ? i : top_got;
        top_want = want[i] > want[top_want] ? i : top_want;
      }
      a.compared += vocab;
      if (top_got == top_want)
        continue;
      const double gap = want[top_want] - want[top_got];
      if (gap <= tolerance * std::max(1.0, std::abs(want[top_want]))) {
        ++a.near_ties;
        continue;
      }
      ++a.top_mismatches;
      if (a.problem.empty()) {
        std::snprintf(text, sizeof(text), "row %d token %d: argmax %zu, want %zu (top-2 gap %.3g)", row, j,
                      top_got - base, top_want - base, gap);
        a.problem = text;
      }
    }
  }
  a.rms_error = a.compared ? std::sqrt(error_squares / a.compared) : 0.0;
  a.rms_noise = a.compared && exact ? std::sqrt(noise_squares / a.compared) : 0.0;
  return a;
}

namespace {

template <class Get>
KvAgreement compare_kv_values(Get got, const LlamaReference& want, double first_layer_slack, double slack) {
  KvAgreement a;
  const LlamaConfig& c = want.config();
  const int hd = c.head_dim;
  const std::vector<double>& kv = want.kv();
  char text[256];
  for (size_t vector = 0; vector < kv.size() / hd; ++vector) {
    const double* w = kv.data() + vector * hd;
    double squares = 0.0;
    for (int d = 0; d < hd; ++d)
      squares += w[d] * w[d];
    const double rms = std::sqrt(squares / hd);
    const size_t layer = vector / (static_cast<size_t>(want.pool_size()) * 2 * c.kv_heads);
    const double allowed_slack = (layer == 0 ? first_layer_slack : slack) * rms;
    for (int d = 0; d < hd; ++d) {
      const double g = got(vector * hd + d), difference = std::abs(g - w[d]);
      int exponent = 0;
      std::frexp(w[d], &exponent);
      const double ulp = w[d] == 0.0 ? 0.0 : std::ldexp(1.0, exponent - 8); // bf16: 8 significant bits
      ++a.compared;
      a.differing += difference != 0.0;
      if (rms > 0.0)
        a.max_excess = std::max(a.max_excess, difference / rms);
      if (!(difference <= ulp + allowed_slack + want.kv_flip()[vector * hd + d]) && a.problem.empty()) {
        const size_t slot = vector / (2 * c.kv_heads) % want.pool_size();
        std::snprintf(text, sizeof(text), "layer %zu slot %zu %s head %zu dim %d: got %.9g, want %.9g", layer,
                      slot, vector / c.kv_heads % 2 ? "V" : "K", vector % c.kv_heads, d, g, w[d]);
        a.problem = text;
      }
    }
  }
  return a;
}

} // namespace

KvAgreement compare_kv(const std::vector<uint16_t>& got, const LlamaReference& want, double first_layer_slack,
                       double slack) {
  if (got.size() != want.kv().size())
    return {0, 0, 0.0, "kv size " + std::to_string(got.size()) + " != " + std::to_string(want.kv().size())};
  return compare_kv_values([&](size_t i) { return bf16_value(got[i]); }, want, first_layer_slack, slack);
}

KvAgreement compare_kv(const LlamaReference& got, const LlamaReference& want, double first_layer_slack,
                       double slack) {
  if (got.kv().size() != want.kv().size())
    return {0, 0, 0.0, "kv sizes differ"};
  return compare_kv_values([&](size_t i) { return got.kv()[i]; }, want, first_layer_slack, slack);
}

} // namespace smcgraph::reference
