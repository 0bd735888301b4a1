// The studio's preset panel: a form over the strategy settings table (core/settings.hpp) and the
// cluster with its runtime settings, turned into a scenario and filled from one.
#include "piper/gui/studio_window.hpp"
#include "piper/gui/studio_window.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>

#include <QAction>
#include <QActionGroup>
#include <QApplication>
#include <QCheckBox>
#include <QComboBox>
#include <QDockWidget>
#include <QCommandLineParser>
#include <QDoubleSpinBox>
#include <QFileDialog>
#include <QFormLayout>
#include <QScrollArea>
#include <QScrollBar>
#include <QLabel>
#include <QMenuBar>
#include <QMessageBox>
#include <QPainter>
#include <QPushButton>
#include <QRegularExpression>
#include <QSaveFile>
#include <QSignalBlocker>
#include <QScrollBar>
#include <QSpinBox>
#include <QSplitter>
#include <QStatusBar>
#include <QSvgGenerator>
#include <QVBoxLayout>
#include <QtConcurrent/QtConcurrentRun>

#include "piper/core/scenario.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"
#include "piper/gui/chrome_trace.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/kernel_table.hpp"
#include "piper/sim/simulate.hpp"

namespace piper::gui {

namespace {

QSpinBox* spin(int lo, int hi, int value) {
  auto* s = new QSpinBox;
  s->setRange(lo, hi);
  s->setValue(value);
  return s;
}

// A field for a setting of the table: a check box, a list of its values, or a number box whose
// lowest value is the default when that is "off" (dp_shard 0, comm_sms 0).
QWidget* setting_field(const core::Setting& s) {
  const nlohmann::json def = core::setting_default(s);
  switch (s.type) {
    case core::SettingType::Bool:
      return new QCheckBox;
    case core::SettingType::String: {
      auto* box = new QComboBox;
      std::vector<std::string> values = core::setting_choices(s);
      if (std::find(values.begin(), values.end(), def.get<std::string>()) == values.end())
        values.insert(values.begin(), def.get<std::string>());
      for (const auto& v : values)
        box->addItem(QString::fromStdString(v.empty() ? "default" : v), QString::fromStdString(v));
      if (core::setting_choices(s).empty()) box->setEditable(true);
      return box;
    }
    case core::SettingType::Int: {
      const int hi = static_cast<int>(std::min<double>(s.max, std::numeric_limits<int>::max()));
      const bool off = def.get<int>() < s.min;
      QSpinBox* box = spin(off ? def.get<int>() : static_cast<int>(s.min), hi, def.get<int>());
      if (off) box->setSpecialValueText("off");
      return box;
    }
    case core::SettingType::Double: {
      auto* box = new QDoubleSpinBox;
      box->setRange(std::min(s.min, def.get<double>()), s.max);
      box->setDecimals(2);
      box->setValue(def.get<double>());
      return box;
    }
  }
  return new QWidget;
}

void set_field(QWidget* w, const core::Setting& s, const nlohmann::json& v) {
  switch (s.type) {
    case core::SettingType::Bool:
      static_cast<QCheckBox*>(w)->setChecked(v.get<bool>());
      break;
    case core::SettingType::Int:
      static_cast<QSpinBox*>(w)->setValue(v.get<int>());
      break;
    case core::SettingType::Double:
      static_cast<QDoubleSpinBox*>(w)->setValue(v.get<double>());
      break;
    case core::SettingType::String: {
      auto* box = static_cast<QComboBox*>(w);
      const int at = box->findData(QString::fromStdString(v.get<std::string>()));
      if (at >= 0)
        box->setCurrentIndex(at);
      else
        box->setCurrentText(QString::fromStdString(v.get<std::string>()));
      break;
    }
  }
}

nlohmann::json field_value(const QWidget* w, const core::Setting& s) {
  switch (s.type) {
    case core::SettingType::Bool:
      return static_cast<const QCheckBox*>(w)->isChecked();
    case core::SettingType::Int:
      return static_cast<const QSpinBox*>(w)->value();
    case core::SettingType::Double:
      return static_cast<const QDoubleSpinBox*>(w)->value();
    case core::SettingType::String: {
      const auto* box = static_cast<const QComboBox*>(w);
      const QVariant data = box->currentData();
      return (data.isValid() && box->currentText() == box->itemText(box->currentIndex()) ? data.toString()
                                                                                         : box->currentText())
          .toStdString();
    }
  }
  return nullptr;
}

// One row of the preset form: each widget after its label, stretched; a widget without a label
// (a check box that names itself) keeps its size.
QWidget* labelled_row(std::initializer_list<std::pair<const char*, QWidget*>> fields) {
  auto* row = new QWidget;
  auto* layout = new QHBoxLayout(row);
  layout->setContentsMargins(0, 0, 0, 0);
  for (const auto& [name, w] : fields) {
    if (name == nullptr) {
      layout->addWidget(w);
      continue;
    }
    layout->addWidget(new QLabel(name));
    layout->addWidget(w, 1);
  }
  return row;
}

// Selects the item of `box` whose data is `value`, adding one shown as `label` when there is none.
void select_data(QComboBox* box, const QString& value, const QString& label) {
  int index = box->findData(value);
  if (index < 0) {
    box->addItem(label, value);
    index = box->count() - 1;
    box->setItemData(index, value, Qt::ToolTipRole);
  }
  box->setCurrentIndex(index);
}

// `box` in a vertical scroll area as wide as the box and its scroll bar.
QScrollArea* scrolled(QWidget* box) {
  auto* scroll = new QScrollArea;
  scroll->setWidget(box);
  scroll->setWidgetResizable(true);
  scroll->setFrameShape(QFrame::NoFrame);
  scroll->setHorizontalScrollBarPolicy(Qt::ScrollBarAlwaysOff);
  scroll->setMinimumWidth(box->sizeHint().width() + scroll->verticalScrollBar()->sizeHint().width());
  return scroll;
}
}  // namespace

QWidget* StudioWindow::build_preset_panel() {
  auto* box = new QWidget;
  auto* form = new QFormLayout(box);
  form->setContentsMargins(0, 0, 0, 0);
  form->setVerticalSpacing(2);
  model_ = new QComboBox;
  model_->setEditable(true);  // zoo name, or a model spec / HF config path
  for (const auto& n : core::zoo_names()) model_->addItem(QString::fromStdString(n));
  // A preset, or the file or inline spec a loaded scenario names (added as an item when it loads).
  cluster_ = new QComboBox;
  for (const auto& n : sim::cluster_presets()) cluster_->addItem(QString::fromStdString(n), QString::fromStdString(n));
  cluster_->setCurrentText(sim::kDefaultCluster);
  runtime_ = new QComboBox;
  runtime_->setObjectName("runtime");
  runtime_->setToolTip(
      "--runtime: the training runtime whose kernels are costed (docs/cost-model.md), over the "
      "cluster's own");
  runtime_->addItem("cluster's", QString());
  for (const auto& n : sim::runtime_profiles()) runtime_->addItem(QString::fromStdString(n), QString::fromStdString(n));
  attention_ = new QComboBox;
  attention_->setObjectName("attention_kernel");
  attention_->setToolTip(
      "--attention-kernel: the attention implementation costed, over the cluster's own (the "
      "ones its kernel tables hold)");
  attention_->addItem("cluster's", QString());
  connect(cluster_, &QComboBox::currentIndexChanged, this, [this] { fill_attention_kernels(); });
  fill_attention_kernels();
  engine_ = new QComboBox;
  for (const auto& n : sim::engine_names()) engine_->addItem(QString::fromStdString(n));
  engine_->setCurrentText(kStudioEngine);
  schedule_ = new QComboBox;
  for (const auto& f : core::schedule_registry()) {
    schedule_->addItem(QString::fromStdString(f.name));
    schedule_->setItemData(schedule_->count() - 1, QString::fromStdString(f.constraints), Qt::ToolTipRole);
  }
  pp_ = spin(1, 4096, 4);
  microbatches_ = spin(1, 4096, 8);
  microbatches_->setObjectName("microbatches");
  // The global batch (sequences per step) decides the microbatches when set: M shows what it
  // resolves to and is read-only meanwhile.
  global_batch_ = spin(0, 1 << 30, 0);
  global_batch_->setObjectName("global_batch");
  global_batch_->setSpecialValueText("off");
  global_batch_->setToolTip("global batch: sequences per step; microbatches = it / (micro-batch size x DP)");
  connect(global_batch_, &QSpinBox::valueChanged, this, [this](int v) { microbatches_->setEnabled(v == 0); });
  virtual_ = spin(1, 64, 1);
  dp_ = spin(1, 65536, 1);
  ep_ = spin(1, 4096, 1);
  zero_ = spin(0, 3, 0);
  dp_shard_ = spin(0, 65536, 0);
  dp_shard_->setSpecialValueText("off");  // 0: plain ZeRO
  dp_shard_->setToolTip("HSDP: ZeRO shards over groups of this many data-parallel replicas (needs ZeRO >= 1)");
  tp_ = spin(1, 1024, 1);
  sequence_parallel_ = new QCheckBox("SP");
  recompute_ = new QComboBox;
  for (const char* mode : {"none", "selective", "full", "op"}) recompute_->addItem(mode);
  form->addRow("<b>Preset</b>", new QWidget);
  form->addRow("model", model_);
  form->addRow("cluster", cluster_);
  form->addRow("runtime", labelled_row({{nullptr, runtime_}, {"attention", attention_}}));
  form->addRow("engine", engine_);
  form->addRow("schedule", schedule_);
  form->addRow("pipeline", labelled_row({{"P", pp_}, {"M", microbatches_}, {"V", virtual_}, {"GB", global_batch_}}));
  form->addRow("data", labelled_row({{"DP", dp_}, {"EP", ep_}, {"ZeRO", zero_}, {"shard", dp_shard_}}));
  form->addRow("tensor", labelled_row({{"TP", tp_}, {nullptr, sequence_parallel_}, {"recompute", recompute_}}));
  // The settings table (core/settings.hpp): its help as each field's tool tip, and a generated field
  // for every setting the rows above do not lay out, so a new setting appears here by itself.
  const std::map<std::string, QWidget*> laid_out = {{"schedule", schedule_},
                                                    {"pp", pp_},
                                                    {"microbatches", microbatches_},
                                                    {"virtual", virtual_},
                                                    {"global_batch", global_batch_},
                                                    {"dp", dp_},
                                                    {"ep", ep_},
                                                    {"zero", zero_},
                                                    {"dp_shard", dp_shard_},
                                                    {"tp", tp_},
                                                    {"sequence_parallel", sequence_parallel_},
                                                    {"recompute", recompute_}};
  for (const core::Setting& setting : core::strategy_settings()) {
    const QString tip = QString::fromStdString(core::setting_flag(setting) + ": " + setting.help);
    if (const auto it = laid_out.find(setting.name); it != laid_out.end()) {
      if (it->second->toolTip().isEmpty()) it->second->setToolTip(tip);
      continue;
    }
    QWidget* field = setting_field(setting);
    field->setObjectName(QString::fromStdString(setting.name));
    field->setToolTip(tip);
    form->addRow(QString::fromStdString(setting.name), field);
    setting_fields_.emplace_back(setting.name, field);
  }
  auto* apply = new QPushButton("Simulate preset");
  connect(apply, &QPushButton::clicked, this, [this] { load_scenario(preset_scenario()); });
  form->addRow(apply);
  // The table grows with every setting: scrolled, so that it never sets the window's minimum height.
  return scrolled(box);
}

void StudioWindow::fill_preset_panel(const core::Scenario& s) {
  model_->setCurrentText(QString::fromStdString(s.model));
  {
    // A derived spec shows as its cluster and settings; any other file or inline spec as itself.
    const std::string cluster = s.cluster.empty() ? std::string(sim::kDefaultCluster) : s.cluster;
    const auto parts = sim::derived_cluster_parts(cluster);
    const QString base = QString::fromStdString(parts ? parts->cluster : cluster);
    select_data(cluster_, base, sim::is_inline_cluster_spec(base.toStdString()) ? "inline spec" : base);
    const QString runtime = QString::fromStdString(parts ? parts->runtime : "");
    const QString attention = QString::fromStdString(parts ? parts->attention_kernel : "");
    select_data(runtime_, runtime, runtime);
    select_data(attention_, attention, attention);
  }
  engine_->setCurrentText(QString::fromStdString(s.engine.empty() ? kStudioEngine : s.engine));
  schedule_->setCurrentText(QString::fromStdString(s.strategy.schedule));
  pp_->setValue(s.strategy.pp);
  global_batch_->setValue(static_cast<int>(std::min<std::int64_t>(s.strategy.global_batch, global_batch_->maximum())));
  int microbatches = s.strategy.microbatches;
  if (s.strategy.global_batch > 0) {
    // What the global batch resolves to (the scenario's microbatches field is then unused); a model
    // that cannot load keeps the field, and the run reports the error.
    try {
      core::StrategyOptions o = s.strategy;
      core::resolve_global_batch(o, core::scenario_model_config(s).training.micro_batch_size);
      microbatches = o.microbatches;
    } catch (const std::exception&) {
    }
  }
  microbatches_->setValue(microbatches);
  microbatches_->setEnabled(s.strategy.global_batch == 0);
  virtual_->setValue(s.strategy.virtual_stages);
  dp_->setValue(s.strategy.dp);
  ep_->setValue(s.strategy.ep);
  zero_->setValue(s.strategy.zero);
  dp_shard_->setValue(s.strategy.dp_shard);
  tp_->setValue(s.strategy.tp);
  sequence_parallel_->setChecked(s.strategy.sequence_parallel);
  recompute_->setCurrentText(QString::fromStdString(s.strategy.recompute));
  for (const auto& [name, field] : setting_fields_) {
    const core::Setting& setting = *core::find_setting(name);
    set_field(field, setting, core::setting_value(setting, s.strategy));
  }
}

core::Scenario StudioWindow::preset_scenario() const {
  core::Scenario s;
  s.model = model_->currentText().toStdString();
  s.cluster = cluster_->currentData().toString().toStdString();
  const std::string runtime = runtime_->currentData().toString().toStdString();
  const std::string attention = attention_->currentData().toString().toStdString();
  if (!runtime.empty() || !attention.empty()) s.cluster = sim::derived_cluster_spec(s.cluster, runtime, attention);
  s.engine = engine_->currentText().toStdString();
  s.strategy.schedule = schedule_->currentText().toStdString();
  s.strategy.pp = pp_->value();
  s.strategy.microbatches = microbatches_->value();
  s.strategy.global_batch = global_batch_->value();
  if (s.model == scenario_a_.model) {
    // The panel has no training-shape fields: keep the loaded scenario's, so a global batch splits alike.
    s.seq_len = scenario_a_.seq_len;
    s.micro_batch_size = scenario_a_.micro_batch_size;
  }
  s.strategy.virtual_stages = virtual_->value();
  s.strategy.dp = dp_->value();
  s.strategy.ep = ep_->value();
  s.strategy.zero = zero_->value();
  s.strategy.dp_shard = dp_shard_->value();
  s.strategy.tp = tp_->value();
  s.strategy.sequence_parallel = sequence_parallel_->isChecked();
  s.strategy.recompute = recompute_->currentText().toStdString();
  for (const auto& [name, field] : setting_fields_) {
    const core::Setting& setting = *core::find_setting(name);
    // A value the field cannot hold (an edited string) is left for the compiler to name.
    try {
      core::set_setting(setting, s.strategy, field_value(field, setting), name);
    } catch (const core::Error&) {
    }
  }
  return s;
}

void StudioWindow::fill_attention_kernels() {
  const QString chosen = attention_->currentData().toString();
  std::vector<std::string> names;
  try {
    names = sim::attention_kernel_names(sim::load_cluster(cluster_->currentData().toString().toStdString()));
  } catch (const std::exception&) {
    // A cluster that does not load offers the cluster's own; simulating it names the error.
  }
  const QSignalBlocker quiet(attention_);
  attention_->clear();
  attention_->addItem("cluster's", QString());
  for (const auto& n : names) attention_->addItem(QString::fromStdString(n), QString::fromStdString(n));
  attention_->setCurrentIndex(std::max(0, attention_->findData(chosen)));
}

}  // namespace piper::gui
