#include "schedulers.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "zero/core/error.hpp"
#include "zero/io/json_limits.hpp"

namespace sdxl {

using nlohmann::json;
using torch::Tensor;

// ---------------------------------------------------------------- sampler names

Sampler parse_sampler(std::string_view name, std::string_view what) {
  if (name == "euler") return Sampler::kEuler;
  if (name == "dpmpp_2m") return Sampler::kDpmpp2m;
  if (name == "dpmpp_2m_karras") return Sampler::kDpmpp2mKarras;
  ZERO_THROW(zero::InvalidArgument, what, ": unknown sampler '", name,
             "' (supported: euler, dpmpp_2m, dpmpp_2m_karras)");
}

std::string_view name_of(Sampler sampler) {
  switch (sampler) {
    case Sampler::kEuler: return "euler";
    case Sampler::kDpmpp2m: return "dpmpp_2m";
    case Sampler::kDpmpp2mKarras: return "dpmpp_2m_karras";
  }
  return "?";
}

// ---------------------------------------------------------------- config parsing
namespace {

// Python's json module writes NaN, Infinity and -Infinity as bare tokens,
// which strict JSON parsers refuse; diffusers' DPM-Solver configs carry
// "lambda_min_clipped": -Infinity. Outside strings, those tokens become the
// strings "NaN", "Infinity", "-Infinity", which number() below accepts.
std::string quote_nonfinite_tokens(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 16);
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) {
        out += text[++i];
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      continue;
    }
    bool replaced = false;
    for (std::string_view token : {"-Infinity", "Infinity", "NaN"}) {
      if (text.substr(i, token.size()) == token) {
        out += '"';
        out += token;
        out += '"';
        i += token.size() - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += c;
  }
  return out;
}

// The keys of one scheduler class: the document's values, diffusers' defaults
// for absent keys, and error messages naming the file and the key.
class Keys {
 public:
  Keys(const json& doc, std::string what) : doc_(doc), what_(std::move(what)) {}

  // The value of `key`, or nullptr when absent.
  const json* find(const char* key) const {
    auto it = doc_.find(key);
    return it == doc_.end() ? nullptr : &*it;
  }

  [[noreturn]] void unsupported(const char* key, const json& value, std::string_view supported) const {
    ZERO_THROW(zero::InvalidArgument, what_, ": key '", key, "' = ", value.dump(),
               " is not supported (supported: ", supported, ")");
  }

  std::int64_t integer(const char* key, std::int64_t fallback, std::int64_t lo, std::int64_t hi) const {
    const json* v = find(key);
    if (!v) return fallback;
    std::int64_t out = 0;
    if (v->is_number_integer()) {
      out = v->get<std::int64_t>();
    } else if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
               std::abs(v->get<double>()) < 9e15) {
      out = static_cast<std::int64_t>(v->get<double>());
    } else {
      unsupported(key, *v, "an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
    }
    if (out < lo || out > hi) unsupported(key, *v, "an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
    return out;
  }

  double number(const char* key, double fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (v->is_number()) return v->get<double>();
    if (v->is_string()) {
      const std::string s = v->get<std::string>();
      if (s == "Infinity") return std::numeric_limits<double>::infinity();
      if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
      if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
    }
    unsupported(key, *v, "a number");
  }

  // diffusers tests these flags for truth, so null means false.
  bool flag(const char* key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (v->is_null()) return false;
    if (!v->is_boolean()) unsupported(key, *v, "true, false");
    return v->get<bool>();
  }

  // One of `allowed` (the default when absent); returns its index.
  std::size_t choice(const char* key, std::initializer_list<std::string_view> allowed, std::string_view fallback) const {
    const json* v = find(key);
    const std::string value = v == nullptr ? std::string(fallback) : v->is_string() ? v->get<std::string>() : "";
    std::size_t index = 0;
    for (std::string_view s : allowed) {
      if (value == s) return index;
      ++index;
    }
    std::string list;
    for (std::string_view s : allowed) list += (list.empty() ? "\"" : ", \"") + std::string(s) + "\"";
    unsupported(key, v ? *v : json(fallback), list);
  }

  void require_false(const char* key) const {
    const json* v = find(key);
    if (v && !(v->is_null() || (v->is_boolean() && !v->get<bool>()))) unsupported(key, *v, "false");
  }
  void require_null(const char* key) const {
    const json* v = find(key);
    if (v && !v->is_null()) unsupported(key, *v, "null");
  }

  const std::string& what() const { return what_; }

 private:
  const json& doc_;
  std::string what_;
};

json parse_document(std::string_view json_text, std::string_view what) {
  const std::string text = quote_nonfinite_tokens(json_text);
  try {
    zero::io::check_json_limits(text, {.max_bytes = SchedulerLimits::kMaxConfigBytes, .max_values = 4096, .max_depth = 8},
                                "scheduler config " + std::string(what));
  } catch (const zero::IoError& e) {
    ZERO_THROW(zero::InvalidArgument, e.message());
  }
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    ZERO_THROW(zero::InvalidArgument, what, ": not valid JSON (", e.what(), ")");
  }
  ZERO_CHECK(doc.is_object(), what, ": expected a JSON object, got ", doc.type_name());
  return doc;
}

}  // namespace

SchedulerConfig parse_scheduler_config(std::string_view json_text, Sampler sampler, std::string_view what) {
  const json doc = parse_document(json_text, what);
  const Keys keys(doc, std::string(what));
  const bool euler = sampler == Sampler::kEuler;

  SchedulerConfig c;
  c.sampler = sampler;
  // Keys both classes read; their defaults are the same in both.
  c.num_train_timesteps = keys.integer("num_train_timesteps", 1000, 2, SchedulerLimits::kMaxTrainTimesteps);
  c.beta_start = keys.number("beta_start", 0.0001);
  c.beta_end = keys.number("beta_end", 0.02);
  for (auto [key, value] : {std::pair{"beta_start", c.beta_start}, std::pair{"beta_end", c.beta_end}}) {
    if (!(value > 0 && value < 1)) keys.unsupported(key, *keys.find(key), "a number in (0, 1)");
  }
  c.beta_schedule =
      keys.choice("beta_schedule", {"linear", "scaled_linear"}, "linear") == 0 ? BetaSchedule::kLinear
                                                                                : BetaSchedule::kScaledLinear;
  keys.require_null("trained_betas");
  c.prediction_type = keys.choice("prediction_type", {"epsilon", "v_prediction"}, "epsilon") == 0
                          ? PredictionType::kEpsilon
                          : PredictionType::kVPrediction;
  c.timestep_spacing = static_cast<TimestepSpacing>(
      keys.choice("timestep_spacing", {"linspace", "leading", "trailing"}, "linspace"));
  c.steps_offset = keys.integer("steps_offset", 0, 0, SchedulerLimits::kMaxTrainTimesteps);
  keys.require_false("rescale_betas_zero_snr");
  keys.require_false("use_exponential_sigmas");
  keys.require_false("use_beta_sigmas");
  keys.choice("final_sigmas_type", {"zero"}, "zero");

  if (euler) {
    c.use_karras_sigmas = keys.flag("use_karras_sigmas", false);
    keys.choice("interpolation_type", {"linear"}, "linear");
    keys.choice("timestep_type", {"discrete"}, "discrete");
    keys.require_null("sigma_min");
    keys.require_null("sigma_max");
  } else {
    // algorithm_type and solver_order are what the sampler's name says (the
    // file's values are overridden, as from_config's keyword arguments do).
    c.use_karras_sigmas = sampler == Sampler::kDpmpp2mKarras || keys.flag("use_karras_sigmas", false);
    keys.choice("solver_type", {"midpoint"}, "midpoint");
    keys.flag("lower_order_final", true);  // with final sigma 0 the last step is first order either way
    keys.flag("euler_at_final", false);    // likewise
    keys.require_false("thresholding");
    keys.require_null("variance_type");
    keys.require_false("use_lu_lambdas");
    keys.require_false("use_flow_sigmas");
    keys.require_false("use_dynamic_shifting");
    const double lambda_min = keys.number("lambda_min_clipped", -std::numeric_limits<double>::infinity());
    if (!(std::isinf(lambda_min) && lambda_min < 0)) {
      keys.unsupported("lambda_min_clipped", *keys.find("lambda_min_clipped"), "-Infinity");
    }
  }
  return c;
}

SchedulerConfig read_scheduler_config(const std::filesystem::path& path, Sampler sampler) {
  std::filesystem::path file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) file = path / "scheduler" / "scheduler_config.json";
  std::ifstream in(file, std::ios::binary);
  if (!in) ZERO_THROW(zero::IoError, "cannot read the scheduler config '", file.string(), "'");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_scheduler_config(text.str(), sampler, "scheduler config '" + file.string() + "'");
}

// ---------------------------------------------------------------- the schedule
namespace {

// NumPy's linspace in float64: i * step + start, the last element exactly stop.
std::vector<double> np_linspace(double start, double stop, std::int64_t num) {
  std::vector<double> y(static_cast<std::size_t>(num));
  const double step = num > 1 ? (stop - start) / static_cast<double>(num - 1) : 0.0;
  for (std::int64_t i = 0; i < num; ++i) y[i] = static_cast<double>(i) * step + start;
  if (num > 1) y.back() = stop;
  return y;
}

// NumPy's arange(start, 0, -step) for a float step: length ceil(-start / -step),
// elements start + i * delta with delta = (start - step) - start (NumPy's fill).
std::vector<double> np_arange_down(double start, double step) {
  const auto length = static_cast<std::int64_t>(std::ceil((0.0 - start) / -step));
  std::vector<double> y;
  if (length <= 0) return y;
  y.resize(static_cast<std::size_t>(length));
  y[0] = start;
  if (length > 1) y[1] = start + -step;
  const double delta = length > 1 ? y[1] - start : 0.0;
  for (std::int64_t i = 2; i < length; ++i) y[i] = start + static_cast<double>(i) * delta;
  return y;
}

// NumPy's round: half to even (the default floating-point rounding mode).
double np_round(double x) { return std::nearbyint(x); }

// np.interp(x, arange(T), fp) in float64, fp given as float32.
double np_interp_unit_grid(double x, const std::vector<float>& fp) {
  const auto last = static_cast<std::int64_t>(fp.size()) - 1;
  if (x <= 0) return fp[0];
  if (x >= static_cast<double>(last)) return fp[last];
  const auto j = static_cast<std::int64_t>(std::floor(x));
  if (static_cast<double>(j) == x) return fp[j];
  const double slope = (static_cast<double>(fp[j + 1]) - static_cast<double>(fp[j])) / 1.0;
  return slope * (x - static_cast<double>(j)) + static_cast<double>(fp[j]);
}

// diffusers' _sigma_to_t: the fractional training step of `sigma`, by linear
// interpolation in log sigma between the neighbouring training steps. The
// log-sigma table is float32 (NumPy's log of a float32 array), the query
// float64; the bracket's width is a float32 difference, as in NumPy.
double sigma_to_t(double sigma, const std::vector<float>& log_sigmas) {
  const double log_sigma = std::log(std::max(sigma, 1e-10));
  const auto n = static_cast<std::int64_t>(log_sigmas.size());
  // argmax of the running count of table entries <= log_sigma: the first
  // index where that count is largest (0 when no entry is <= log_sigma).
  std::int64_t count = 0, best = -1, low_idx = 0;
  for (std::int64_t k = 0; k < n; ++k) {
    if (log_sigma - static_cast<double>(log_sigmas[k]) >= 0) ++count;
    if (count > best) {
      best = count;
      low_idx = k;
    }
  }
  low_idx = std::min(low_idx, n - 2);
  const std::int64_t high_idx = low_idx + 1;
  const float low = log_sigmas[low_idx], high = log_sigmas[high_idx];
  double w = (static_cast<double>(low) - log_sigma) / static_cast<double>(low - high);
  w = std::clamp(w, 0.0, 1.0);
  return (1.0 - w) * static_cast<double>(low_idx) + w * static_cast<double>(high_idx);
}

// Karras et al.'s schedule between sigma_max and sigma_min, rho = 7, in float64.
std::vector<double> karras_sigmas(double sigma_min, double sigma_max, std::int64_t steps) {
  const double rho = 7.0;
  const std::vector<double> ramp = np_linspace(0.0, 1.0, steps);
  const double min_inv_rho = std::pow(sigma_min, 1.0 / rho);
  const double max_inv_rho = std::pow(sigma_max, 1.0 / rho);
  std::vector<double> out(ramp.size());
  for (std::size_t i = 0; i < ramp.size(); ++i) out[i] = std::pow(max_inv_rho + ramp[i] * (min_inv_rho - max_inv_rho), rho);
  return out;
}

std::vector<float> to_vector(const Tensor& t) {
  const Tensor c = t.to(torch::kFloat32).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

std::vector<float> log_of(const std::vector<float>& values) {
  std::vector<float> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = std::log(values[i]);
  return out;
}

// The sigmas as diffusers stores them: float32, a final 0 appended.
Tensor sigmas_tensor(const std::vector<double>& sigmas) {
  Tensor out = torch::zeros({static_cast<std::int64_t>(sigmas.size()) + 1}, torch::kFloat32);
  auto* p = out.data_ptr<float>();
  for (std::size_t i = 0; i < sigmas.size(); ++i) p[i] = static_cast<float>(sigmas[i]);
  return out;
}

}  // namespace

Scheduler::Scheduler(SchedulerConfig config) : config_(std::move(config)) {
  const std::int64_t T = config_.num_train_timesteps;
  ZERO_CHECK(T >= 2 && T <= SchedulerLimits::kMaxTrainTimesteps, "scheduler: num_train_timesteps = ", T,
             " is out of range (2..", SchedulerLimits::kMaxTrainTimesteps, ")");
  torch::NoGradGuard no_grad;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  // float32 as diffusers builds them (torch.linspace in float32, then cumprod).
  Tensor betas = config_.beta_schedule == BetaSchedule::kLinear
                     ? torch::linspace(config_.beta_start, config_.beta_end, T, f32)
                     : torch::linspace(std::pow(config_.beta_start, 0.5), std::pow(config_.beta_end, 0.5), T, f32).pow(2);
  const Tensor alphas = 1.0 - betas;
  alphas_cumprod_ = torch::cumprod(alphas, 0);
  training_sigmas_ = ((1 - alphas_cumprod_) / alphas_cumprod_).pow(0.5);
}

void Scheduler::check_steps(std::int64_t steps) const {
  ZERO_CHECK(steps >= 1 && steps <= config_.num_train_timesteps, "sampling steps = ", steps,
             ": expected 1 to num_train_timesteps (", config_.num_train_timesteps, ")");
}

void Scheduler::check_index(std::int64_t index, const char* call) const {
  ZERO_CHECK(num_steps() > 0, "scheduler ", call, ": set_timesteps() was not called");
  ZERO_CHECK(index >= 0 && index < num_steps(), "scheduler ", call, ": step index ", index, " is outside 0..",
             num_steps() - 1);
}

namespace {

// ---------------------------------------------------------------- Euler

class EulerDiscrete final : public Scheduler {
 public:
  using Scheduler::Scheduler;

  void set_timesteps(std::int64_t steps) override {
    check_steps(steps);
    const std::int64_t T = config_.num_train_timesteps;
    std::vector<float> timesteps;  // float32, as diffusers' NumPy arrays
    switch (config_.timestep_spacing) {
      case TimestepSpacing::kLinspace:
        for (double t : np_linspace(0.0, static_cast<double>(T - 1), steps)) timesteps.push_back(static_cast<float>(t));
        std::reverse(timesteps.begin(), timesteps.end());
        break;
      case TimestepSpacing::kLeading: {
        const std::int64_t ratio = T / steps;
        for (std::int64_t i = steps - 1; i >= 0; --i)
          timesteps.push_back(static_cast<float>(i * ratio) + static_cast<float>(config_.steps_offset));
        break;
      }
      case TimestepSpacing::kTrailing:
        for (double t : np_arange_down(static_cast<double>(T), static_cast<double>(T) / static_cast<double>(steps)))
          timesteps.push_back(static_cast<float>(np_round(t)) - 1.0f);
        break;
    }
    const std::vector<float> train = to_vector(training_sigmas_);
    std::vector<double> sigmas;
    for (float t : timesteps) sigmas.push_back(np_interp_unit_grid(static_cast<double>(t), train));
    if (config_.use_karras_sigmas) {
      sigmas = karras_sigmas(sigmas.back(), sigmas.front(), steps);
      const std::vector<float> log_sigmas = log_of(train);
      timesteps.clear();
      for (double s : sigmas) timesteps.push_back(static_cast<float>(sigma_to_t(s, log_sigmas)));
    }
    timesteps_ = torch::tensor(timesteps, torch::kFloat32);
    sigmas_ = sigmas_tensor(sigmas);
  }

  Tensor init_noise_sigma() const override {
    ZERO_CHECK(num_steps() > 0, "scheduler init_noise_sigma: set_timesteps() was not called");
    const Tensor max_sigma = sigmas_.max();
    if (config_.timestep_spacing != TimestepSpacing::kLeading) return max_sigma;
    return (max_sigma.pow(2) + 1).pow(0.5);
  }

  Tensor scale_model_input(const Tensor& sample, std::int64_t index) const override {
    check_index(index, "scale_model_input");
    const Tensor sigma = sigmas_[index];
    return sample / (sigma.pow(2) + 1).pow(0.5);
  }

  Tensor step(const Tensor& model_output, std::int64_t index, const Tensor& sample) override {
    check_index(index, "step");
    torch::NoGradGuard no_grad;
    // diffusers' order of operations (no churn: sigma_hat = sigma), in float32.
    const Tensor x = sample.to(torch::kFloat32);
    const Tensor sigma = sigmas_[index];
    Tensor denoised;
    if (config_.prediction_type == PredictionType::kEpsilon) {
      denoised = x - sigma * model_output;
    } else {
      denoised = model_output * (-sigma / (sigma.pow(2) + 1).pow(0.5)) + (x / (sigma.pow(2) + 1));
    }
    const Tensor derivative = (x - denoised) / sigma;
    const Tensor dt = sigmas_[index + 1] - sigma;
    return (x + derivative * dt).to(model_output.scalar_type());
  }
};

// ---------------------------------------------------------------- DPM-Solver++ (2M)

class DpmSolverMultistep final : public Scheduler {
 public:
  using Scheduler::Scheduler;

  void set_timesteps(std::int64_t steps) override {
    check_steps(steps);
    const std::int64_t T = config_.num_train_timesteps;
    const std::int64_t last = T;  // lambda_min_clipped = -inf clips nothing
    std::vector<std::int64_t> timesteps;
    switch (config_.timestep_spacing) {
      case TimestepSpacing::kLinspace: {
        const std::vector<double> t = np_linspace(0.0, static_cast<double>(last - 1), steps + 1);
        for (std::int64_t i = steps; i >= 1; --i) timesteps.push_back(static_cast<std::int64_t>(np_round(t[i])));
        break;
      }
      case TimestepSpacing::kLeading: {
        const std::int64_t ratio = last / (steps + 1);
        for (std::int64_t i = steps; i >= 1; --i) timesteps.push_back(i * ratio + config_.steps_offset);
        break;
      }
      case TimestepSpacing::kTrailing:
        for (double t : np_arange_down(static_cast<double>(last), static_cast<double>(T) / static_cast<double>(steps)))
          timesteps.push_back(static_cast<std::int64_t>(np_round(t)) - 1);
        break;
    }
    const std::vector<float> train = to_vector(training_sigmas_);
    std::vector<double> sigmas;
    if (config_.use_karras_sigmas) {
      sigmas = karras_sigmas(static_cast<double>(train.front()), static_cast<double>(train.back()), steps);
      const std::vector<float> log_sigmas = log_of(train);
      timesteps.clear();
      for (double s : sigmas) timesteps.push_back(static_cast<std::int64_t>(np_round(sigma_to_t(s, log_sigmas))));
    } else {
      for (std::int64_t t : timesteps) sigmas.push_back(np_interp_unit_grid(static_cast<double>(t), train));
    }
    timesteps_ = torch::tensor(timesteps, torch::kInt64);
    sigmas_ = sigmas_tensor(sigmas);
    history_[0] = history_[1] = Tensor();
    lower_order_steps_ = 0;
    next_index_ = 0;
  }

  Tensor init_noise_sigma() const override { return torch::tensor(1.0f); }

  Tensor scale_model_input(const Tensor& sample, std::int64_t index) const override {
    check_index(index, "scale_model_input");
    return sample;
  }

  Tensor step(const Tensor& model_output, std::int64_t index, const Tensor& sample) override {
    check_index(index, "step");
    ZERO_CHECK(index == next_index_, "DPM-Solver step ", index, " out of order: a multistep solver needs steps 0, 1, "
               "... in sequence (expected step ", next_index_, "; set_timesteps() restarts)");
    torch::NoGradGuard no_grad;
    const Tensor denoised = data_prediction(model_output, index, sample);
    history_[0] = history_[1];
    history_[1] = denoised;
    const Tensor x = sample.to(torch::kFloat32);
    // The final sigma is 0: that step is always first order (lower_order_final).
    const bool final_step = index == num_steps() - 1;
    Tensor prev = lower_order_steps_ < 1 || final_step ? first_order(denoised, index, x) : second_order(index, x);
    if (lower_order_steps_ < 2) ++lower_order_steps_;
    ++next_index_;
    return prev.to(denoised.scalar_type());
  }

 private:
  struct AlphaSigma {
    Tensor alpha, sigma, lambda;
  };
  // alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma * alpha_t, lambda = log alpha_t - log sigma_t
  // (0-dim float32 tensors, as diffusers computes them).
  AlphaSigma alpha_sigma(std::int64_t i) const {
    const Tensor s = sigmas_[i];
    const Tensor alpha = (s.pow(2) + 1).pow(0.5).reciprocal();
    const Tensor sigma = s * alpha;
    return {alpha, sigma, torch::log(alpha) - torch::log(sigma)};
  }

  Tensor data_prediction(const Tensor& model_output, std::int64_t index, const Tensor& sample) const {
    const AlphaSigma s = alpha_sigma(index);
    if (config_.prediction_type == PredictionType::kEpsilon) return (sample - s.sigma * model_output) / s.alpha;
    return s.alpha * sample - s.sigma * model_output;
  }

  Tensor first_order(const Tensor& d0, std::int64_t index, const Tensor& x) const {
    const AlphaSigma t = alpha_sigma(index + 1), s = alpha_sigma(index);
    const Tensor h = t.lambda - s.lambda;
    return (t.sigma / s.sigma) * x - (t.alpha * (torch::exp(-h) - 1.0)) * d0;
  }

  Tensor second_order(std::int64_t index, const Tensor& x) const {
    const AlphaSigma t = alpha_sigma(index + 1), s0 = alpha_sigma(index), s1 = alpha_sigma(index - 1);
    const Tensor& m0 = history_[1];
    const Tensor& m1 = history_[0];
    const Tensor h = t.lambda - s0.lambda;
    const Tensor h0 = s0.lambda - s1.lambda;
    const Tensor r0 = h0 / h;
    const Tensor d1 = (r0.reciprocal() * 1.0) * (m0 - m1);
    const Tensor coefficient = t.alpha * (torch::exp(-h) - 1.0);
    return (t.sigma / s0.sigma) * x - coefficient * m0 - (coefficient * 0.5) * d1;
  }

  Tensor history_[2];  // data predictions of the previous and the current step
  std::int64_t lower_order_steps_ = 0;
  std::int64_t next_index_ = 0;
};

}  // namespace

std::unique_ptr<Scheduler> make_scheduler(const SchedulerConfig& config) {
  if (config.sampler == Sampler::kEuler) return std::make_unique<EulerDiscrete>(config);
  return std::make_unique<DpmSolverMultistep>(config);
}

}  // namespace sdxl
